"""Kill what a driver's local Ray cluster left behind when the driver dies without cleaning up (SIGKILL, a crash).

Ray ties gcs_server and raylet to the driver that started them
(PR_SET_PDEATHSIG), but not what raylet starts: after a SIGKILL of the
driver its rank actors died within 3 s, while its two agents (DashboardAgent,
RuntimeEnvAgent) lived another 62 s, reporting the raylet's death to a GCS
that was gone too and waiting out Ray's 60 s reconnect timeout.

The watchdog is a process of its own (its own session, so a Ctrl-C at the
terminal never reaches it) that holds the read end of a pipe from the
driver. The kernel closes the driver's end when the driver exits, however it
exits, and that wakes the watchdog: it then SIGKILLs every Ray process it has
seen below the driver, and their children. It looks at the driver's process
tree every 0.5 s (a few ms of /proc reads), because once the driver is gone
those processes are no longer its descendants. A process counts as Ray's if
its command line is ``ray::...`` or runs a file under a ``/ray/`` folder
(gcs_server, raylet, Ray's Python daemons); anything else the driver started
is left alone. Start times guard against a pid reused in the meantime.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

LOOK_EVERY_S = 0.5


def start_watchdog(wait_until_watching: bool = False) -> subprocess.Popen:
    """Start watching this process; close the returned process's ``stdin`` (or exit) to have it clean up and go.

    ``wait_until_watching``: return only once it has looked at the process tree (it says so on its stdout), so
    what runs below this process now is known to it, however slowly a loaded machine starts it.
    """
    stdout = subprocess.PIPE if wait_until_watching else subprocess.DEVNULL
    watchdog = subprocess.Popen([sys.executable, "-m", "openpack.orchestration.watchdog", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)
    if wait_until_watching:
        watchdog.stdout.readline()
    return watchdog


def stop_watchdog(watchdog: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """Have the watchdog kill what is left of the cluster now, and wait until it has."""
    watchdog.stdin.close()
    try:
        watchdog.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        watchdog.kill()


def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time, command line) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[19]), cmdline)
    return table


def _is_ray(cmdline: str) -> bool:
    return cmdline.startswith("ray::") or "/ray/" in cmdline


def ray_processes_below(root: int, known: dict[int, int], table: dict) -> dict[int, int]:
    """pid -> start time of the Ray processes below ``root`` and of everything below a Ray or ``known`` process."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = {}
    todo = [(root, False)] + [(pid, True) for pid, start in known.items() if table.get(pid, (0, None))[1] == start]
    while todo:
        parent, under_ray = todo.pop()
        for pid in children.get(parent, []):
            if pid == os.getpid() or pid in found:
                continue
            ray = under_ray or _is_ray(table[pid][2])
            if ray:
                found[pid] = table[pid][1]
            todo.append((pid, ray))
    return found


def watch(driver: int) -> None:
    """Until the pipe on stdin closes, remember the Ray processes below ``driver``; then kill them."""
    known = ray_processes_below(driver, {}, _processes())
    print("watching", flush=True)  # what start_watchdog(wait_until_watching=True) waits for
    while True:
        readable, _, _ = select.select([0], [], [], LOOK_EVERY_S)
        if readable and not os.read(0, 4096):
            break
        known.update(ray_processes_below(driver, known, _processes()))
    table = _processes()
    known.update(ray_processes_below(driver, known, table))  # and what they started since the last look
    for pid, start in known.items():
        if table.get(pid, (0, None))[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stray Ctrl-C must not stop the clean-up
    watch(int(sys.argv[1]))
