"""The watchdog kills the Ray processes of a driver that died without cleaning up (SIGKILL), and nothing else.

A fake driver stands in for the real one (the Ray version is test_ray_launcher.py's
``test_a_killed_driver_leaves_no_ray_process``): it starts a process that looks like Ray's (``/ray/`` in its
command line, as raylet and gcs_server have) with a child of its own, and a process that is not Ray's.
"""

import os
import signal
import subprocess
import sys
import time

FAKE_DRIVER = """
import subprocess, sys, time
from openpack.orchestration.watchdog import start_watchdog
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
raylet = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                           "p = subprocess.Popen(sys.argv[2:]); print(p.pid, flush=True); time.sleep(120)",
                           "/fake/ray/raylet", *sleeper], stdout=subprocess.PIPE, text=True)
worker = int(raylet.stdout.readline())
other = subprocess.Popen(sleeper)
dog = start_watchdog(wait_until_watching=True)  # it has seen raylet and its worker
print(raylet.pid, worker, other.pid, dog.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_driver_killed_with_sigkill_takes_its_ray_processes_along():
    driver = subprocess.Popen([sys.executable, "-c", FAKE_DRIVER], stdout=subprocess.PIPE, text=True)
    raylet, worker, other, dog = map(int, driver.stdout.readline().split())
    driver.kill()
    driver.wait()
    deadline = time.time() + 60  # a hang guard: the loop ends as soon as they are gone
    while (alive(raylet) or alive(worker) or alive(dog)) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert not alive(raylet) and not alive(worker), "Ray-looking processes outlived their driver"
        assert not alive(dog), "the watchdog itself lingers"
        assert alive(other), "the watchdog killed a process that is not Ray's"
    finally:
        for pid in (raylet, worker, other):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
