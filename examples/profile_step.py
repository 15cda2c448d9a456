"""One optimizer step of an openpack command under ``torch.profiler``: where a step's time goes, by op.

    python examples/profile_step.py --step 3 train_dpo --launcher local --bf16 --pretrain ... --max_steps 3

The command runs exactly as ``openpack <command> ...`` (same process, same CLI); only step ``--step`` (counted
from 1; take one after the first, which holds the warm-up) runs inside the profiler. It prints that step's wall
time and the ops that took the most time: on a GPU the kernels by self CUDA time and the host side by self CPU
time, so a step that waits on its host (Python hooks, copies, syncs) shows apart from one that waits on its
kernels. ``--trace FILE.json`` also writes a Chrome trace.

Why (issue 43): on an H200, ``openpack train_dpo`` spent about 0.19 s more per optimizer step than the same
kernels without DeepSpeed (``benchmarks/gpu_mfu.py``), a fixed cost per step, not per token. Profiling happens
here, beside the trainer (``run_steps`` is wrapped from outside), not inside it. The offline commands (SFT, DPO,
RM) step through ``trainers/run.run_steps``; online RL has its own loop and is not profiled by this script.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def profiled(step_fn, which: int, rows: int, trace: Path | None):
    """``step_fn`` with its call number ``which`` run under the profiler, the report printed after it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    calls = {"n": 0}

    def step(planned):
        calls["n"] += 1
        if calls["n"] != which:
            return step_fn(planned)
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            began = time.perf_counter()
            metrics = step_fn(planned)
            dict(metrics)  # the step's metrics read to the host: the step is done when they are
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - began
        averages = prof.key_averages()
        print(f"\nprofile_step: step {which} took {wall:.3f} s", flush=True)
        if cuda:
            print(averages.table(sort_by="self_cuda_time_total", row_limit=rows), flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
        if trace is not None:
            prof.export_chrome_trace(str(trace))
        return metrics

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=int, default=2, help="the optimizer step to profile, from 1 (default 2)")
    parser.add_argument("--rows", type=int, default=25, help="ops listed per table")
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace of the step here")
    args, command = parser.parse_known_args(argv)
    if not command or command[0] not in ("train_sft", "train_dpo", "train_rm"):
        parser.error("name an offline command and its flags: train_sft, train_dpo or train_rm ...")
    from openpack.cli.main import main as openpack_main
    from openpack.trainers import run

    plain = run.run_steps

    def run_steps(step, *rest, **kwargs):
        return plain(profiled(step, args.step, args.rows, args.trace), *rest, **kwargs)

    run.run_steps = run_steps
    return openpack_main(command)


if __name__ == "__main__":
    sys.exit(main())
