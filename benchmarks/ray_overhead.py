"""Ray launcher overhead: the same DPO run via ``--launcher local`` and via Ray with one worker.

Both arms run the real CLI in a fresh subprocess on the same tiny Llama, the
same pairs and flags, interleaved local, ray, local, ray, ... in one
invocation. Reported per arm (min / median / max over repeats):

* wall time of the whole command (Ray: starting a local cluster, the
  placement group and the actor, and tearing them down);
* median step time from ``metrics.jsonl`` (the first step is warm-up and left
  out), i.e. what Ray costs per optimizer step once training runs.

    python benchmarks/ray_overhead.py [--repeats 2] [--steps 20] [--markdown docs/benchmarks.md]

With ``--markdown`` the section between the ``ray_overhead`` markers of that
file is replaced (appended if absent).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402


def write_inputs(folder: Path, pairs: int) -> tuple[str, str]:
    """A random-init Llama (hidden 256, 4 layers, vocab of the demo tokenizer) and character-level pairs."""
    sys.path.insert(0, str(ROOT))
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.tiny import tiny_causal_lm

    tokenizer = build_demo_tokenizer()
    model = tiny_causal_lm("llama", seed=0, vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=1024)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rng = random.Random(0)
    with open(folder / "pairs.jsonl", "w") as f:
        for _ in range(pairs):
            word = "".join(rng.choice("0123456789") for _ in range(rng.randint(20, 200)))
            answer = "".join(sorted(word))
            f.write(json.dumps({"prompt": f"sort {word}=", "chosen": answer, "rejected": answer[::-1]}) + "\n")
    return str(folder / "model"), str(folder / "pairs.jsonl")


def run_arm(launcher: str, model: str, data: str, steps: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "openpack.cli.main", "train_dpo", "--pretrain", model, "--dataset", data,
            "--save_path", str(out), "--launcher", launcher, "--train_batch_size", "16", "--max_steps", str(steps),
            "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "2048", "--max_len", "512",
            "--learning_rate", "1e-5", "--zero_stage", "2"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{launcher} run failed:\n{result.stderr[-3000:]}")
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    step_times = [m["step_time_s"] for m in metrics if "step_time_s" in m][1:]
    return {"wall_s": wall, "step_s": statistics.median(step_times), "loss": [m["loss"] for m in metrics]}


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def report(results: dict[str, list[dict]], args, command: str) -> str:
    local, ray = results["local"], results["ray"]
    wall_over = [r["wall_s"] - l["wall_s"] for l, r in zip(local, ray)]
    step_over = [r["step_s"] - l["step_s"] for l, r in zip(local, ray)]
    step_ratio = statistics.median(r["step_s"] for r in ray) / statistics.median(l["step_s"] for l in local)
    loss_diff = max(abs(a - b) for r in local + ray for a, b in zip(r["loss"], local[0]["loss"]))
    lines = [
        "## Ray launcher overhead (`benchmarks/ray_overhead.py`)",
        "",
        "```",
        command,
        "```",
        "",
        f"Machine: {os.cpu_count()}-core CPU, no GPU ({platform.platform()}); run on {datetime.date.today()}. "
        f"The same `openpack train_dpo` run ({args.steps} steps of 16 pairs packed into rows of 2048 tokens, "
        "a random-init Llama of hidden 256 and 4 layers, ZeRO-2, gloo) via `--launcher local` and via Ray with "
        f"one worker (the default), interleaved local, ray, ... {args.repeats} times each. Step times are "
        "medians over each run's steps after the first (warm-up); min / median / max over repeats.",
        "",
        "| launcher | wall time of the command (s) | median step time (s) |",
        "|---|---:|---:|",
        f"| local | {spread([r['wall_s'] for r in local])} | {spread([r['step_s'] for r in local])} |",
        f"| ray, 1 worker | {spread([r['wall_s'] for r in ray])} | {spread([r['step_s'] for r in ray])} |",
        f"| ray - local, paired | {spread(wall_over)} | {spread(step_over)} |",
        "",
        f"Per step, the paired difference ray - local is {statistics.median(step_over) * 1000:+.1f} ms (median; "
        f"ray / local step time {step_ratio:.3f}x), within the run-to-run spread of each launcher: the worker runs "
        "the whole training loop inside its actor, so nothing crosses Ray between steps. What Ray adds is a fixed "
        "cost per command: "
        f"{statistics.median(wall_over):.1f} s (median) to start a local cluster, reserve the placement group, "
        "start the actor and tear it all down. The largest difference of a per-step loss between any two runs "
        f"(either launcher) was {loss_diff:.2g}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--markdown", type=Path, help="replace the ray_overhead section of this file")
    args = parser.parse_args()
    command = "python benchmarks/ray_overhead.py " + " ".join(sys.argv[1:])
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = write_inputs(Path(tmp), pairs=16 * args.steps)
        for repeat in range(args.repeats):
            for launcher in ("local", "ray"):
                result = run_arm(launcher, model, data, args.steps, Path(tmp) / f"{launcher}{repeat}")
                results[launcher].append(result)
                print(f"{launcher} #{repeat}: wall {result['wall_s']:.1f} s, median step {result['step_s']:.3f} s",
                      flush=True)
    section = report(results, args, command.strip())
    print(section)
    if args.markdown:
        harness.write_section(args.markdown, "ray_overhead", section)


if __name__ == "__main__":
    main()
