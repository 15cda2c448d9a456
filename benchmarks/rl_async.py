"""Asynchronous RL on CPU: the GRPO demo with ``--async_train --max_staleness 1`` vs the synchronous loop.

    python benchmarks/rl_async.py [--repeats 3] [--steps 10] [--launcher ray] [--out DIR] [-- TRAIN_GRPO_FLAGS]

Each run is ``openpack train_grpo`` with the built-in demo's settings (``--config`` its grpo.yaml: 32 prompts x 8
completions per rollout batch, exact match on the bare answer, vLLM rollouts) on its cached SFT model and prompts,
copied into the work folder once, so code edited meanwhile neither retrains the model nor changes the data, and
without the demo's held-out evaluation; ``--steps`` rollout batches, in a fresh process; runs alternate sync, async,
sync, async... so drifting load hits both arms alike. A step's time is ``step_time_s`` from the run's
metrics.jsonl (generation wait, reward, experience, training, weight sync), the first step left out (it waits
for the first batch either way); a run's number is the median of the rest, and the ratio is async / sync per
repeat pair, reported as median (min-max).

What async can win is bounded by the smaller of generation and training per step: with the generator one batch
ahead, a step costs about max(generation, training) instead of their sum. On a 2-core machine the vLLM engine
and the trainer compete for the same cores, so the overlap buys less than on separate devices; the numbers are
what this machine gives, not what a GPU cluster would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"sync": [], "async": ["--async_train", "--max_staleness", "1"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="rollout batches per run (--max_steps)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved")
    parser.add_argument("--launcher", default="ray", choices=["ray", "local"],
                        help="ray: the engine is a Ray actor; local: in the trainer's process, on a worker thread")
    parser.add_argument("--out", type=Path, default=None, help="work folder to keep (runs, logs, results.json)")
    parser.add_argument("extra", nargs="*", help="after --: flags given to train_grpo in both arms (another workload, "
                                                 "e.g. -- --generate_max_len 32 --temperature 2.0)")
    return parser.parse_args(argv)


def prepare(work: Path) -> list[str]:
    """--pretrain, --prompt_data and the demo's config: its cached SFT model (trained first if missing) and prompts."""
    code = ("from openpack.config.commands import demo_sft_model; from openpack.config.sections import LaunchConfig; "
            "print(demo_sft_model(LaunchConfig(launcher='local'), 42))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    shutil.copytree(found.stdout.strip().splitlines()[-1], work / "model", dirs_exist_ok=True)
    from openpack.config.rl import DEMO_CONFIG
    from openpack.trainers import demo

    return ["--config", str(DEMO_CONFIG), "--pretrain", str(work / "model"), "--prompt_data",
            *demo.write_prompt_data(work, True), "--label_key", "response"]


def run(arm: str, save_path: Path, args, inputs: list[str]) -> dict:
    cmd = [sys.executable, "-m", "openpack.cli.main", "train_grpo", *inputs, "--max_steps", str(args.steps),
           "--launcher", args.launcher, "--save_path", str(save_path), *args.extra, *ARMS[arm]]
    start = time.perf_counter()
    with open(save_path.with_suffix(".log"), "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise SystemExit(f"{arm} run failed (exit {code}); see {save_path.with_suffix('.log')}")
    with open(save_path / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    steps = [m for m in metrics if "step_time_s" in m][1:]
    return {"arm": arm, "wall_s": time.perf_counter() - start,
            **{key: statistics.median(m[key] for m in steps) for key in
               ("step_time_s", "time/generation", "time/training", "time/experience", "time/weight_sync")},
            "staleness": statistics.mean(m.get("async/staleness", 0.0) for m in steps),
            "reward_last": metrics[-1].get("reward")}


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.out or Path(tempfile.mkdtemp(prefix="rl_async_"))
    work.mkdir(parents=True, exist_ok=True)
    inputs = prepare(work)
    load = [os.getloadavg()[0]]
    runs = []
    for repeat in range(args.repeats):
        for arm in ARMS:
            result = run(arm, work / f"{arm}{repeat}", args, inputs)
            runs.append(result)
            print(f"{arm} #{repeat}: step {result['step_time_s']:.3f} s (generation wait "
                  f"{result['time/generation']:.3f} s, training {result['time/training']:.3f} s), "
                  f"wall {result['wall_s']:.0f} s", flush=True)
    load.append(os.getloadavg()[0])
    ratios = [a["step_time_s"] / s["step_time_s"] for s, a in zip(runs[::2], runs[1::2])]
    print(f"\n{'arm':6} | median step s | generation wait s | training s | experience s | weight sync s")
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        print(f"{arm:6} | " + " | ".join(f"{statistics.median(r[key] for r in mine):.3f}" for key in
                                         ("step_time_s", "time/generation", "time/training", "time/experience",
                                          "time/weight_sync")))
    print(f"train_grpo flags added to the demo's: {' '.join(args.extra) or 'none'}")
    print(f"step-time ratio async / sync: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}), "
          f"load average {load[0]:.1f} -> {load[1]:.1f}, {os.cpu_count()} CPUs")
    # issue 26's bound: a step that hides generation costs max(generation, the rest), the sync arm's phases
    sync = [r for r in runs if r["arm"] == "sync"]
    generation = statistics.median(r["time/generation"] for r in sync)
    rest = statistics.median(r["step_time_s"] - r["time/generation"] for r in sync)
    bound = max(generation, rest)
    async_step = statistics.median(r["step_time_s"] for r in runs if r["arm"] == "async")
    print(f"sync: generation {generation:.3f} s = {100 * generation / (generation + rest):.0f}% of a step, the rest "
          f"{rest:.3f} s; async step / max(generation, rest) = {async_step / bound:.2f}")
    (work / "results.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                   "runs": runs, "ratios": ratios, "load_average": load,
                                                   "async_over_bound": async_step / bound}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
