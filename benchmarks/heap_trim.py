"""What trimming the C heap costs a tiny model's CPU training: the agent demo's SFT stage under three trim policies.

    python benchmarks/heap_trim.py [--steps 120] [--repeats 2] [--modes always margin never]

CPU training hands the heap's free pages back to the OS (``openpack.models.memory``). ``always`` trims after every
backward and optimizer step (issue 23's first fix), ``margin`` only after the resident set grew by ``TRIM_MARGIN``
(``HeapTrimmer``, what training does), ``never`` not at all. Each run is its own process, with the demo's files
built in a fresh cache folder, ``openpack train_sft`` run in that process with the demo's flags and
``--launcher local --max_steps N``; the runs alternate the modes, ``--repeats`` rounds. Printed: the seconds from
the command's start to its end and the process's peak resident memory. Real models: ``memory_real_model.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

MODES = ("always", "margin", "never")

CHILD = r"""
import json, resource, sys, time

import openpack.distributed.engine as engine
from openpack.models.memory import HeapTrimmer, release_freed_memory


class Always(HeapTrimmer):
    def __call__(self):
        release_freed_memory()


class Never(HeapTrimmer):
    def __call__(self):
        pass


engine.HeapTrimmer = {"always": Always, "margin": HeapTrimmer, "never": Never}[sys.argv[1]]
from openpack.cli.train_sft import main
from openpack.trainers.agent_demo import prepare

_, args = prepare(42)
start = time.perf_counter()
main([*args, "--launcher", "local", "--max_steps", sys.argv[2]])
print("RESULT " + json.dumps({"s": time.perf_counter() - start,
                              "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
"""


def run(mode: str, steps: int) -> dict:
    cache = tempfile.mkdtemp(prefix=f"heap_trim_{mode}_")
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, mode, str(steps)], capture_output=True, text=True,
                              env={**os.environ, "OPENPACK_CACHE": cache})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode or result is None:
        sys.exit(f"heap_trim: the {mode} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(result[len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps of each run")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the modes, alternating")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="trim policies to run")
    args = parser.parse_args(argv)
    print("| trim | run | seconds | peak RSS (MiB) |\n|---|---:|---:|---:|")
    for repeat in range(args.repeats):
        for mode in args.modes:
            result = run(mode, args.steps)
            print(f"| {mode} | {repeat + 1} | {result['s']:.1f} | {result['peak_mib']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
