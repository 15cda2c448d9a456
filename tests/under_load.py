"""Run a command N times while CPU hogs keep every core busy, and count the failures.

    python tests/under_load.py --repeat 20 -- python -m pytest -q -p no:cacheprovider \\
        tests/integration/test_rollout_zero3.py

Starts ``--hogs`` processes (default: one per core) that spin ``while True: pass``, runs the command
``--repeat`` times one after another, ends the hogs (also on Ctrl-C or an error), and prints one line per run
(exit code, seconds) and a summary line: runs, failures, wall seconds (min / median / max), load average.
Exit code 1 when any run failed. ``--log DIR`` keeps each run's output as DIR/run-K.log; without it the
output of failed runs only is printed (its last 60 lines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOG = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="how many times to run the command")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy-loop processes (default: cores)")
    parser.add_argument("--log", type=Path, help="a folder for each run's output (run-K.log)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    if args.log:
        args.log.mkdir(parents=True, exist_ok=True)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    results = []
    try:
        for k in range(1, args.repeat + 1):
            start = time.monotonic()
            run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            seconds = time.monotonic() - start
            results.append((run.returncode, seconds))
            print(f"run {k}/{args.repeat}: exit {run.returncode}, {seconds:.1f} s, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            if args.log:
                (args.log / f"run-{k}.log").write_text(run.stdout)
            elif run.returncode != 0:
                print("\n".join(run.stdout.splitlines()[-60:]), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    failures = sum(code != 0 for code, _ in results)
    times = [s for _, s in results]
    print(f"summary: {len(results)} runs, {failures} failed, {args.hogs} hogs, seconds min {min(times):.1f} "
          f"median {statistics.median(times):.1f} max {max(times):.1f}, total {sum(times):.0f}; "
          f"command: {' '.join(command)}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
