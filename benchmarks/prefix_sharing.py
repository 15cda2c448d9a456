"""DPO with and without --prefix_sharing on CPU: tokens computed and seconds per optimizer step.

    python benchmarks/prefix_sharing.py [--repeats 2] [--steps 4] [--scale 4] [--vocab 1024] [--markdown PATH]
    python benchmarks/prefix_sharing.py --smoke --out /tmp/x     # seconds-long check of the script

Both arms run ``openpack train_dpo --packing_samples --use_dynamic_batch`` on the same saved model,
reference and pairs (the ANCHORS length mix divided by ``--scale``), in fresh interleaved processes; one arm
adds ``--prefix_sharing``, so each pair is one group prompt | chosen | rejected and its prompt is computed
once, by the policy and by the reference. The losses must agree (the layouts compute the same numbers), so
the script checks them. Reported over the steps after the first (warm-up): real tokens per step (what the
model computes: 2 x prompt + chosen + rejected per pair without sharing, prompt + chosen + rejected with it),
packed rows per step and seconds per step, as median (min-max) over repeats.

The model defaults to vocab 1024 so that, as in a large LM, the LM head is a small share of the work
(``--vocab 32000``, the TRL comparisons' model, makes the head most of it; sharing does not shrink the head,
which projects only the response tokens either way).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import ModelSpec

SECTION = "prefix_sharing"
ARMS = ("unshared", "prefix_sharing")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs_per_step", type=int, default=16, help="pairs per optimizer step")
    harness.add_run_args(parser, SECTION, learning_rate=5e-6)
    parser.set_defaults(vocab=1024, steps=4)
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    args.given = " ".join(w for i, w in enumerate(given) if w != "--out" and (i == 0 or given[i - 1] != "--out"))
    if args.smoke:
        args.pairs_per_step = 8
        harness.apply_smoke(args)
    args.markdown, _ = harness.docs_outputs(args.markdown, None, SECTION, args.smoke)
    return args


def prepare(args, work: Path) -> dict:
    lengths = harness.scaled_lengths(args.pairs_per_step * args.steps, args.scale, args.seed)
    row_cap = harness.ROW_CAP // args.scale
    model = ModelSpec(args.vocab, args.hidden, args.intermediate, args.layers, max_position_embeddings=2 * row_cap)
    policy, reference = harness.save_models(work, model, seeds=[0, 1])
    data = harness.write_jsonl(work / "pairs.jsonl", harness.preference_rows(lengths, args.seed))
    return {"work": work, "policy": policy, "reference": reference, "model": model, "data": data,
            "row_cap": row_cap, "max_tokens": 16384 // args.scale, "lengths": lengths}


def command(args, setup: dict, save_path: Path, shared: bool) -> list[str]:
    return [
        "-m", "openpack.cli.main", "train_dpo", "--launcher", "local",
        "--pretrain", str(setup["policy"]), "--ref_pretrain", str(setup["reference"]), "--dataset", str(setup["data"]),
        "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", str(setup["max_tokens"]),
        "--max_len", str(setup["row_cap"]), "--train_batch_size", str(args.pairs_per_step),
        "--max_steps", str(args.steps), "--learning_rate", str(args.learning_rate), "--lr_scheduler", "constant",
        "--lr_warmup_ratio", "0", "--beta", "0.1", "--loss_type", "sigmoid", "--seed", str(args.seed),
        "--save_path", str(save_path), *(["--prefix_sharing"] if shared else []),
    ]


def run_arm(args, setup: dict, run_dir: Path, env: dict, shared: bool) -> dict:
    measured = harness.run_measured(command(args, setup, run_dir, shared), run_dir.with_suffix(".log"), env)
    harness.check_run(measured, f"openpack train_dpo ({'shared' if shared else 'unshared'})")
    keep = ("loss", "grad_norm", "pairs", "tokens", "micro_batches", "step_time_s")
    steps = [{k: s[k] for k in keep} for s in harness.read_jsonl(run_dir / "metrics.jsonl")]
    return {"steps": steps, "peak_rss_mb": measured.peak_rss_mb, "wall_s": measured.wall_s}


def summarise(runs: list[dict]) -> dict:
    measured = lambda run, key: [s[key] for s in run["steps"][1:]]  # noqa: E731
    per_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    unshared, shared = per_arm["unshared"], per_arm["prefix_sharing"]
    loss_diff = max(abs(a["loss"] - b["loss"]) for u, s in zip(unshared, shared)
                    for a, b in zip(u["steps"], s["steps"]))
    tokens = {arm: sum(measured(rs[0], "tokens")) / len(measured(rs[0], "tokens")) for arm, rs in per_arm.items()}
    rows = {arm: sum(measured(rs[0], "micro_batches")) / len(measured(rs[0], "micro_batches"))
            for arm, rs in per_arm.items()}
    return {
        "step_time_s": harness.by_arm(runs, "step_time_s"),
        "tokens_per_step": tokens, "rows_per_step": rows,
        "token_reduction": 1 - tokens["prefix_sharing"] / tokens["unshared"],
        "time_reduction": [1 - s["step_time_s"] / u["step_time_s"] for u, s in zip(unshared, shared)],
        "max_loss_diff": loss_diff,
    }


def table(s: dict) -> str:
    lines = ["| layout | real tokens / step | packed rows / step | s / optimizer step |", "|---|---:|---:|---:|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {s['tokens_per_step'][arm]:.0f} | {s['rows_per_step'][arm]:.1f} "
                     f"| {harness.fmt_spread(s['step_time_s'][arm], '{:.2f}')} |")
    lines.append(f"| **prefix sharing saves** | **{100 * s['token_reduction']:.1f}%** | | "
                 f"**{harness.fmt_spread([100 * t for t in s['time_reduction']], '{:.1f}')}%** |")
    return "\n".join(lines)


def markdown_section(args, setup: dict, s: dict, wall_s: float) -> str:
    cmd = harness.shell_command(command(args, setup, setup["work"] / "RUN_DIR", True))
    cmd = cmd.replace(f"{setup['work']}/", "")
    return f"""## DPO prefix sharing: `--prefix_sharing` vs two sequences per pair (`benchmarks/prefix_sharing.py`)

```
python benchmarks/prefix_sharing.py {args.given}
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s; each arm ran {args.repeats}x,
interleaved; times are median (min-max) over repeats, the saving per repeat pair. The machine was shared
with other jobs, so single timings move by 10-50%. Model:
{setup['model'].describe()}; fp32; a reference of the same shape (another seed). Data:
{args.pairs_per_step * args.steps} pairs ({args.steps} steps of {args.pairs_per_step}, the first not counted),
{harness.scaled_mix_description(args.scale)}; `--max_tokens_per_gpu {setup['max_tokens']}`, sigmoid loss,
{args.threads} thread(s) (`--threads`). The shared arm's command (the other drops `--prefix_sharing`):

```
{cmd}
```

{table(s)}

The two layouts give the same run: the largest per-step loss difference is {s['max_loss_diff']:.1e}.
Tokens: each prompt is computed once instead of twice (ANCHORS: 22.6% of the tokens on the unscaled mix).
Time falls by less than the tokens: the LM head projects the same response tokens either way, the
optimizer step does not shrink, and the attention of a rejected response still reads its prompt's keys.
"""


def benchmark(args, work: Path) -> int:
    started = time.perf_counter()
    setup = prepare(args, work)
    print(f"model: {setup['model'].describe()}")
    env = harness.subprocess_env(args.threads)
    runs = harness.run_interleaved({
        arm: (lambda repeat, arm=arm: run_arm(args, setup, work / f"{arm}_{repeat}", env, arm == "prefix_sharing"))
        for arm in ARMS
    }, args.repeats)
    summary = summarise(runs)
    wall_s = time.perf_counter() - started
    print(table(summary))
    print(f"largest per-step loss difference {summary['max_loss_diff']:.1e}; wall time {wall_s:.0f} s")
    (work / "results.json").write_text(json.dumps({"runs": runs, "summary": summary, "wall_s": wall_s}, indent=1))
    if args.markdown is not None:
        harness.write_section(args.markdown, SECTION, markdown_section(args, setup, summary, wall_s))
    return 0 if summary["max_loss_diff"] < 1e-4 else 1


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, None, "prefix_sharing_")


if __name__ == "__main__":
    sys.exit(main())
