"""DPO on CPU, one run, four arms: unshared vs --prefix_sharing vs TRL's DPOTrainer, and LoRA's memory.

    python benchmarks/prefix_sharing.py [--repeats 2] [--steps 4] [--scale 4] [--threads 1] [--markdown PATH]
    python benchmarks/prefix_sharing.py --smoke --out /tmp/x     # seconds-long check of the script (CI)

Every arm trains the same saved model against the same saved reference (another seed, so the step-1 loss
is not the trivial ln 2) on the same pairs in the same steps (the ANCHORS length mix divided by
``--scale``), each in a fresh process, the arms interleaved over ``--repeats``:

* ``unshared``: ``openpack train_dpo --packing_samples --use_dynamic_batch`` (``dpo_vs_trl.py``'s command):
  a pair's chosen and rejected are two segments of a packed row, each with its own copy of the prompt;
* ``prefix_sharing``: adds ``--prefix_sharing``: each pair is one group prompt | chosen | rejected and its
  prompt is computed once, by the policy and by the reference;
* ``prefix_sharing+lora``: adds ``--lora_rank 16 --lora_alpha 32``. ``--ref_pretrain`` stays, so the reference
  is still the separate saved model (train_dpo uses the adapters-off policy only without ``--ref_pretrain``)
  and the arm differs from ``prefix_sharing`` by LoRA alone; LoRA's B starts at zero, so its step-1 loss
  equals the full arms';
* ``trl``: TRL 1.16's DPOTrainer through ``dpo_vs_trl.py``'s worker: padded micro-batches of 8 pairs, the
  pairs written in openpack's step order, the same hyperparameters.

Reported over the steps after the first (warm-up): real tokens computed per step (2 x prompt + chosen +
rejected per pair without sharing, prompt + chosen + rejected with it; TRL's padding counted apart),
seconds per optimizer step and each process's peak RSS, as median (min-max) over repeats; and, per round
of the interleaving, prefix sharing's saving in tokens and step time against ``unshared``, TRL's step time
over each openpack layout's, and LoRA's peak RSS over full DPO's (both prefix-shared). Checked: the two
layouts give the same losses at every step; step 1's loss is the same in every arm; TRL trained on the same
real tokens per step.

The model defaults to vocab 1024 so that, as in a large LM, the LM head is a small share of the work
(``--vocab 32000``, dpo_vs_trl's model, makes the head most of it; sharing does not shrink the head,
which projects only the response tokens either way). The trade-off of one run: the TRL arm is the
slowest, so a round costs about as much as the three openpack arms together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpo_vs_trl
import harness

SECTION = "prefix_sharing"
LORA_RANK, LORA_ALPHA = 16, 32
OPENPACK_FLAGS = {  # each openpack arm's flags on top of dpo_vs_trl.openpack_command
    "unshared": (),
    "prefix_sharing": ("--prefix_sharing",),
    "prefix_sharing+lora": ("--prefix_sharing", "--lora_rank", str(LORA_RANK), "--lora_alpha", str(LORA_ALPHA)),
}
ARMS = (*OPENPACK_FLAGS, "trl")
TARGETS = {"tokens": 0.20, "time": 0.15}  # issue 16: prefix sharing's saving on the mix, on CPU
SAME_LOSS = 1e-4  # fp32, the same numbers in another order


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    micro_batch = dpo_vs_trl.TRL_MICRO_BATCH
    parser.add_argument("--pairs_per_step", type=int, default=16,
                        help=f"pairs per optimizer step (a multiple of TRL's micro-batch, {micro_batch})")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (sigmoid loss)")
    harness.add_run_args(parser, SECTION, learning_rate=5e-6)
    parser.set_defaults(vocab=1024, steps=4)
    args = parser.parse_args(argv)
    args.given = harness.given_flags(argv)
    if args.smoke:
        args.pairs_per_step = 8
        harness.apply_smoke(args)
    if args.pairs_per_step % micro_batch:
        parser.error(f"--pairs_per_step must be a multiple of TRL's micro-batch of {micro_batch}")
    args.markdown, args.chart = harness.docs_outputs(args.markdown, args.chart, SECTION, args.smoke)
    return args


def run_all(args, setup: dict, work: Path) -> list[dict]:
    """Every arm ``--repeats`` times, interleaved; each result also holds the load average at its start."""
    env = harness.subprocess_env(args.threads)

    def arm(name: str):
        def run(repeat: int) -> dict:
            load = os.getloadavg()
            run_dir = work / f"{name.replace('+', '_')}_{repeat}"
            if name == "trl":
                result = dpo_vs_trl.run_trl(args, setup, run_dir, env)
            else:
                result = dpo_vs_trl.run_openpack(args, setup, run_dir, env, OPENPACK_FLAGS[name])
            return {**result, "load_at_start": load}
        return run

    return harness.run_interleaved({name: arm(name) for name in ARMS}, args.repeats)


# ---------------------------------------------------------------- summary


def per_step(run: dict, key: str) -> float:
    """Mean of ``key`` over the measured steps (all but the first)."""
    steps = run["steps"][1:] or run["steps"]
    return sum(s[key] for s in steps) / len(steps)


def paired(runs: tuple[list[dict], list[dict]], ratio) -> list[float]:
    """``ratio(a_run, b_run)`` for each round of the interleaving; ``runs``: two arms' runs in repeat order."""
    return [ratio(a, b) for a, b in zip(*runs)]


def summarise(runs: list[dict]) -> dict:
    per_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    unshared, shared, lora, trl = (per_arm[arm] for arm in ARMS)
    if per_step(trl[0], "tokens") != per_step(unshared[0], "tokens"):
        raise RuntimeError("TRL did not train on the same real tokens per step as openpack: has openpack's step "
                           "order (core/schedule.epoch_steps) changed?")
    step = lambda a, b: a["step_time_s"] / b["step_time_s"]  # noqa: E731
    rss = lambda a, b: a["peak_rss_mb"] / b["peak_rss_mb"]  # noqa: E731
    first_loss = {arm: [r["steps"][0]["loss"] for r in rs] for arm, rs in per_arm.items()}
    tokens = {arm: per_step(rs[0], "tokens") for arm, rs in per_arm.items()}
    return {
        "step_time_s": harness.by_arm(runs, "step_time_s"), "peak_rss_mb": harness.by_arm(runs, "peak_rss_mb"),
        "tokens_per_step": tokens,
        "positions_per_step": {arm: per_step(rs[0], "slots" if arm == "trl" else "tokens")
                               for arm, rs in per_arm.items()},
        "micro_batches_per_step": {arm: per_step(rs[0], "micro_batches") for arm, rs in per_arm.items()},
        "token_reduction": 1 - tokens["prefix_sharing"] / tokens["unshared"],
        "time_reduction": [1 - r for r in paired((shared, unshared), step)],
        "trl_step_time_over": {"unshared": paired((trl, unshared), step),
                               "prefix_sharing": paired((trl, shared), step)},
        "lora_time_ratio": paired((lora, shared), step),
        "lora_rss_ratio": paired((lora, shared), rss),
        "lora_rss_diff_mb": paired((lora, shared), lambda a, b: a["peak_rss_mb"] - b["peak_rss_mb"]),
        # unshared and prefix_sharing compute the same numbers in another layout: every step agrees
        "max_loss_diff": max(abs(a["loss"] - b["loss"]) for u, s in zip(unshared, shared)
                             for a, b in zip(u["steps"], s["steps"])),
        "first_step_loss": first_loss,
        "first_step_loss_diff": {arm: max(abs(a - b) for a, b in zip(first_loss[arm], first_loss["unshared"]))
                                 for arm in ARMS[1:]},
        "trl_max_step_loss_diff": max(abs(a["loss"] - b["loss"]) for u, t in zip(unshared, trl)
                                      for a, b in zip(u["steps"], t["steps"])),
        "load_at_start": [r["load_at_start"][0] for r in runs],
    }


def checks_pass(s: dict) -> bool:
    return s["max_loss_diff"] < SAME_LOSS and max(s["first_step_loss_diff"].values()) < SAME_LOSS


# ---------------------------------------------------------------- text


def results_table(s: dict) -> str:
    lines = ["| arm | real tokens computed / step | micro-batches / step | s / optimizer step | peak RSS (MiB) |",
             "|---|---:|---:|---:|---:|"]
    for arm in ARMS:
        tokens = f"{s['tokens_per_step'][arm]:.0f}"
        if s["positions_per_step"][arm] != s["tokens_per_step"][arm]:
            tokens += f" ({s['positions_per_step'][arm]:.0f} with padding)"
        lines.append(f"| `{arm}` | {tokens} | {s['micro_batches_per_step'][arm]:.1f} "
                     f"| {harness.fmt_spread(s['step_time_s'][arm], '{:.2f}')} "
                     f"| {harness.fmt_spread(s['peak_rss_mb'][arm])} |")
    return "\n".join(lines)


def percent(values: list[float]) -> str:
    return harness.fmt_spread([100 * v for v in values], "{:.1f}") + "%"


def ratios_table(s: dict) -> str:
    spread = harness.fmt_spread
    rows = {
        "prefix sharing: fewer real tokens computed than `unshared`": f"**{100 * s['token_reduction']:.1f}%**",
        "prefix sharing: lower s / step than `unshared`": f"**{percent(s['time_reduction'])}**",
        "`trl` s / step over `unshared` s / step": spread(s["trl_step_time_over"]["unshared"], "{:.2f}x"),
        "`trl` s / step over `prefix_sharing` s / step": spread(s["trl_step_time_over"]["prefix_sharing"], "{:.2f}x"),
        "`prefix_sharing+lora` peak RSS over `prefix_sharing`":
            f"{spread(s['lora_rss_ratio'], '{:.3f}x')} ({spread(s['lora_rss_diff_mb'], '{:+.0f}')} MiB)",
        "`prefix_sharing+lora` s / step over `prefix_sharing`": spread(s["lora_time_ratio"], "{:.2f}x"),
    }
    return "\n".join(["| ratio (per round of the interleaving) | median (min-max) |", "|---|---:|",
                      *(f"| {name} | {value} |" for name, value in rows.items())])


def loss_text(s: dict) -> str:
    first = {arm: values[0] for arm, values in s["first_step_loss"].items()}
    diffs = s["first_step_loss_diff"]
    return (f"Losses: `unshared` and `prefix_sharing` agree at every step of every round (largest difference "
            f"{s['max_loss_diff']:.1e}). Step 1 (the same weights, reference and pairs everywhere): "
            + ", ".join(f"`{arm}` {loss:.6f}" for arm, loss in first.items())
            + f"; the largest difference from `unshared` is {diffs['prefix_sharing']:.1e} (`prefix_sharing`), "
            f"{diffs['prefix_sharing+lora']:.1e} (`prefix_sharing+lora`, whose adapters start at zero) and "
            f"{diffs['trl']:.1e} (`trl`). Over whole runs `trl` and `unshared` differ by at most "
            f"{s['trl_max_step_loss_diff']:.1e} per step.")


def arms_text(args, setup: dict) -> str:
    model = setup["model"]
    lora = model.lora_parameters(LORA_RANK)
    return f"""The arms (all: the same model, the same reference `llama_seed1`, the same pairs in the same steps):

* `unshared`: the command below without `--prefix_sharing`: a pair's chosen and rejected are two
  segments of a packed row, each with its own copy of the prompt.
* `prefix_sharing`: the command below: each pair is one group prompt | chosen | rejected, its prompt
  computed once by the policy and once by the reference.
* `prefix_sharing+lora`: the command below plus `--lora_rank {LORA_RANK} --lora_alpha {LORA_ALPHA}`: peft adapters
  on every linear layer but the LM head, {lora / 1e3:.0f}k trainable weights instead of all
  {model.parameters() / 1e6:.1f}M. `--ref_pretrain` stays, so the reference is the same separate model as
  in the other arms (train_dpo makes the adapters-off policy the reference only when `--ref_pretrain` is
  absent) and this arm differs from `prefix_sharing` by LoRA alone. A LoRA run without `--ref_pretrain`
  would also drop the reference's {model.parameters() * 4 / 2**20:.1f} MiB of fp32 weights (not measured
  here), but its reference would then be the policy's own initial weights, not this one.
* `trl`: TRL's DPOTrainer, `benchmarks/dpo_vs_trl.py`'s worker, with `ref_model` the same saved reference,
  padded micro-batches of {dpo_vs_trl.TRL_MICRO_BATCH} pairs and the pairs written in openpack's step order."""


def change(fraction: float) -> str:
    """A saving as prose: 0.12 -> '12.0% lower', -0.05 -> '5.0% higher'."""
    return f"{100 * fraction:.1f}% lower" if fraction >= 0 else f"{-100 * fraction:.1f}% higher"


def prefix_verdict(s: dict) -> str:
    tokens = s["token_reduction"]
    low, mid, high = harness.spread(s["time_reduction"])
    target = lambda key: f"the issue's target of at least {TARGETS[key]:.0%}"  # noqa: E731
    token_part = f"meets {target('tokens')}" if tokens >= TARGETS["tokens"] else f"**misses** {target('tokens')}"
    if low >= TARGETS["time"]:
        time_part = f"meets {target('time')} in every round"
    elif mid >= TARGETS["time"]:
        time_part = f"meets {target('time')} on the median, though not in every round"
    else:
        time_part = f"**misses** {target('time')}"
    if mid >= tokens:
        why = "Time falls by more than the tokens on this run; read it with the per-round range."
    elif mid > 0:
        why = ("Time falls by less than the tokens: the LM head projects the same response tokens either way, "
               "the optimizer step does not shrink, and a rejected response's attention still reads its "
               "prompt's keys.")
    else:
        why = "Sharing saved no time on this run."
    per_round = f"; per round from {change(high)} to {change(low)}" if len(s["time_reduction"]) > 1 else ""
    return (f"**Prefix sharing, its own ratio.** Tokens: {100 * tokens:.1f}% fewer (each prompt computed once "
            f"instead of twice; ANCHORS: 22.6% over 20000 pairs of this mix), which {token_part}. Step time: "
            f"{change(mid)} (median over rounds{per_round}), which {time_part}. {why}")


def trl_verdict(s: dict, setup: dict) -> str:
    parts = []
    for arm in ("unshared", "prefix_sharing"):
        ratio = harness.spread(s["trl_step_time_over"][arm])[1]
        parts.append(f"`{arm}` is {ratio:.2f}x faster" if ratio >= 1 else f"`{arm}` is {1 / ratio:.2f}x slower")
    padding = s["positions_per_step"]["trl"] / s["tokens_per_step"]["trl"]
    return (f"**openpack vs TRL (the same pairs per step).** Per optimizer step, {parts[0]} than `trl` and "
            f"{parts[1]}. TRL pads the chosen and rejected rows of {dpo_vs_trl.TRL_MICRO_BATCH} pairs to the "
            f"longest of them, so its model computes {padding:.2f}x the real tokens, and it computes each prompt "
            "twice, as `unshared` does. The DPO vs TRL section explains the rest of the gap: on CPU TRL's LM head "
            f"projects every position, padding and prompts included; here the head is "
            f"{setup['model'].head_share():.0%} of the weight matmuls per token.")


# A check outside this script (2026-11-23, this file's default model; one forward and backward of an 11632-token
# row through transformers and through peft's LoRA, 1 thread): why LoRA's peak RSS can exceed full training's.
LORA_RSS_CHECK = (
    "The increase is not live tensors. A check outside this script (2026-11-23, the same model, one forward and "
    "backward of an 11632-token row through plain transformers and through peft 0.21's LoRA): peft's model "
    "saves fewer bytes for its backward (saved-tensor hooks, 4096 tokens: 313 vs 350 MB), and with glibc told "
    "to hand freed large blocks back to the system (`MALLOC_MMAP_THRESHOLD_=65536`) LoRA's peak RSS was "
    "107 MiB below full training's (1523 vs 1630 MiB) instead of 410 MiB above it (2398 vs 1988 MiB). Each "
    "adapted linear layer computes `result + lora_B(lora_A(x)) * scaling`, three more row-sized temporaries, "
    "and glibc's default allocator keeps the memory they free in the process; peak RSS, what this benchmark "
    "measures, counts it.")


def lora_verdict(s: dict, setup: dict) -> str:
    model = setup["model"]
    diffs = s["lora_rss_diff_mb"]
    low, mid, high = harness.spread(diffs)
    ratio = harness.spread(s["lora_rss_ratio"])[1]
    per_round = f", per round {low:+.0f} to {high:+.0f} MiB" if len(diffs) > 1 else ""
    state = model.parameters() * 16 / 2**20
    full_peak = harness.spread(s["peak_rss_mb"]["prefix_sharing"])[1]
    time_ratio = harness.spread(s["lora_time_ratio"])[1]
    state_text = (f"full DPO keeps, for each of its {model.parameters() / 1e6:.1f}M weights, a gradient, AdamW's two "
                  "moments and the fp32 master copy DeepSpeed's ZeRO optimizer clones (16 bytes each: "
                  f"{state:.0f} MiB before DeepSpeed's gradient buffers, {state / full_peak:.0%} of full DPO's "
                  "peak), LoRA only for its adapters")
    if mid <= 0:
        memory = (f"LoRA's peak RSS is {-mid:.0f} MiB lower than full DPO's ({ratio:.3f}x; median over "
                  f"rounds{per_round}). What LoRA removes is the training state of the frozen weights: "
                  f"{state_text}. The rest of the peak is the libraries, both models' weights and the activations "
                  "of a packed row, which LoRA keeps.")
    else:
        memory = (f"LoRA's peak RSS is **{mid:.0f} MiB higher** than full DPO's ({ratio:.3f}x; median over "
                  f"rounds{per_round}), although LoRA drops the training state of the frozen weights: "
                  f"{state_text}. {LORA_RSS_CHECK}")
    return (f"**Memory, LoRA vs full DPO (both prefix-shared, the same reference).** {memory} Time per step: "
            f"{change(1 - time_ratio)} with LoRA (its backward computes no gradient for the frozen weights; its "
            "adapters add small matmuls).")


def load_text(args, s: dict, before: tuple, after: tuple) -> str:
    fmt = lambda load: "/".join(f"{v:.2f}" for v in load)  # noqa: E731
    low, _, high = harness.spread(s["load_at_start"])
    if high > args.threads + 0.5:  # more than this script's own run
        shared = (" The machine was shared with other jobs, so single timings move by 10-50%."
                  + (" One thread per run (`--threads 1`) keeps them from stalling OpenMP regions."
                     if args.threads == 1 else ""))
    else:
        shared = " The load is about this script's own run: the machine was otherwise idle."
    return (f"Load average (1/5/15 min) on the machine's {os.cpu_count()} cores: {fmt(before)} before the "
            f"script, {fmt(after)} after; the 1-minute load was {low:.2f}-{high:.2f} as each run started."
            + shared)


def markdown_section(args, setup: dict, s: dict, wall_s: float, load: tuple) -> str:
    cmd = harness.shell_command([*dpo_vs_trl.openpack_command(args, setup, setup["work"] / "RUN_DIR"),
                                 *OPENPACK_FLAGS["prefix_sharing"]])
    cmd = cmd.replace(f"{setup['work']}/", "")  # paths relative to the work folder
    image = (f"![DPO step time and peak memory per arm]({os.path.relpath(args.chart, args.markdown.parent)})\n\n"
             if args.chart else "")
    return f"""## DPO prefix sharing vs unshared vs TRL, and LoRA's memory (`benchmarks/prefix_sharing.py`)

```
python benchmarks/prefix_sharing.py {args.given}
```

Machine: {harness.machine_description()}; {harness.code_description()}. The script took {wall_s:.0f} s
({wall_s / 60:.1f} min); each arm ran {args.repeats}x, interleaved in rounds ({', '.join(ARMS)}, then again);
cells are median (min-max) over repeats, ratios are taken per round. {load_text(args, s, *load)}

{arms_text(args, setup)}

{dpo_vs_trl.setup_text(args, setup, {'real_tokens_per_step': s['tokens_per_step']['unshared']})} The
`prefix_sharing` arm's command (paths relative to the work folder):

```
{cmd}
```

{results_table(s)}

{ratios_table(s)}

{image}{loss_text(s)}

{prefix_verdict(s)}

{trl_verdict(s, setup)}

{lora_verdict(s, setup)}

Not measured: a GPU (the flash-attn and torch varlen paths of prefix sharing have not run here), and LoRA
at a size where its saving is large (`openpack/models/lora.py`: a 1.5B model at rank 16 trains ~18M
weights).
"""


def chart(path: Path, s: dict) -> None:
    labels = [arm.replace("_", "\n").replace("+", "\n+ ") for arm in ARMS]  # short lines under the bars
    harness.save_bar_charts(path, [
        harness.Panel("seconds / optimizer step (lower is better)", "s", labels,
                      {"DPO": [s["step_time_s"][arm] for arm in ARMS]}, "%.1f"),
        harness.Panel("peak resident memory (lower is better)", "GiB", labels,
                      {"DPO": [[v / 1024 for v in s["peak_rss_mb"][arm]] for arm in ARMS]}, "%.2f"),
    ], "DPO on CPU: prefix sharing, LoRA and TRL 1.16 DPOTrainer")


def benchmark(args, work: Path) -> int:
    started, load_before = time.perf_counter(), os.getloadavg()
    setup = dpo_vs_trl.prepare(args, work)
    print(f"model: {setup['model'].describe()}; load average {load_before}")
    runs = run_all(args, setup, work)
    summary = summarise(runs)
    wall_s, load_after = time.perf_counter() - started, os.getloadavg()
    print(results_table(summary), ratios_table(summary), loss_text(summary), sep="\n\n")
    print(f"wall time {wall_s:.0f} s; load average {load_before} before, {load_after} after")
    (work / "results.json").write_text(json.dumps({"runs": runs, "summary": summary, "wall_s": wall_s,
                                                   "load_before": load_before, "load_after": load_after}, indent=1))
    if args.markdown is not None:
        chart(args.chart, summary)
        harness.write_section(args.markdown, SECTION,
                              markdown_section(args, setup, summary, wall_s, (load_before, load_after)))
    return 0 if checks_pass(summary) else 1


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, None, "prefix_sharing_")


if __name__ == "__main__":
    sys.exit(main())
