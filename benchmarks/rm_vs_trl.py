"""Reward models on CPU: openpack train_rm (packed pairs, token-budget micro-batches) vs TRL 1.16's RewardTrainer.

    python benchmarks/rm_vs_trl.py [--repeats 4] [--steps 8] [--threads 1] [--scale 4] [--markdown docs/benchmarks.md]
    python benchmarks/rm_vs_trl.py --smoke --out /tmp/x     # seconds-long check of the harness (CI)

Both frameworks train the same saved reward model (the DPO benchmark's small
random-init Llama, fp32, as a one-label sequence classifier whose value head
is saved with it, so neither draws its own) on the same preference pairs in
the same order, with the same pairs per optimizer step, max length and
hyperparameters (pairwise sigmoid loss, lr, constant schedule, AdamW betas,
clipping). Each run is a fresh subprocess; runs alternate openpack, TRL,
openpack, TRL...

* openpack: ``openpack train_rm --packing_samples --use_dynamic_batch
  --max_tokens_per_gpu N --launcher local``: a pair's two sequences are
  segments of a packed row of <= N tokens, each read at its last token;
  nothing is padded.
* TRL: ``RewardTrainer`` with its defaults (8 pairs per micro-batch, chosen
  and rejected right-padded to the longest of the 16 rows, the reward read at
  the last token that is not pad) and gradient accumulation so a step has the
  same pairs. Settings that differ from TRL's defaults, none favouring
  openpack: fp32 (``bf16=False``; its default is bf16, which a CPU fp32
  comparison cannot use), gradient checkpointing off (its default is on,
  openpack's off: both run without it), a constant lr with no warm-up (as
  openpack is told), and a sequential sampler over the pairs written in
  openpack's step order, so every step of both runs holds the same pairs and
  their per-step losses must agree.

The head is drawn with std 1/sqrt(width) (not the config's 0.02) so rewards
spread over about one unit and the step-1 loss is not the trivial ln 2.

One torch thread per arm by default, unlike the DPO and SFT scripts: on 2
cores shared with other work, two intra-op threads stall whenever another
process holds a core, and a reward step is so small that the stalls were the
measurement (both frameworks 8-11 s per step, ratio about 1.0, against
about 1 and 3 s on one thread with the same neighbour; see docs/benchmarks.md).

Reported over the steps after the first (warm-up): real (non-padding)
tokens/s, pairs/s and seconds per optimizer step from each framework's own
step timer; each process's peak resident memory; and openpack / TRL per
repeat, as median (min-max). Lengths are the ANCHORS mix divided by
``--scale`` (stated in the output) so that a run fits the CPU budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from dpo_vs_trl import (
    OPENPACK_DEFAULT_CAP,
    TRL_MICRO_BATCH,
    describe_micro_batch,
    mean_over,
    step_record,
    step_work,
)
from harness import ModelSpec

from openpack.core.schedule import epoch_steps

ARMS = ("openpack", "TRL")
SECTION = "rm_vs_trl"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs_per_step", type=int, default=16, help="pairs per optimizer step (a multiple of 8)")
    harness.add_run_args(parser, SECTION, learning_rate=1e-4)  # TRL's RewardConfig default
    # a reward step costs a fraction of a DPO step (no reference, no LM head): more steps and repeats, same budget;
    # one thread: see the module docstring
    parser.set_defaults(steps=8, repeats=4, threads=1)
    args = parser.parse_args(argv)
    args.command = f"python benchmarks/rm_vs_trl.py {harness.given_flags(argv)}".rstrip()
    if args.smoke:
        args.pairs_per_step = 8
        harness.apply_smoke(args)
    args.markdown, args.chart = harness.docs_outputs(args.markdown, args.chart, SECTION, args.smoke)
    if args.pairs_per_step % TRL_MICRO_BATCH:
        parser.error(f"--pairs_per_step must be a multiple of TRL's micro-batch of {TRL_MICRO_BATCH} pairs")
    return args


# ---------------------------------------------------------------- TRL, in its own process


def trl_worker(spec_path: Path) -> int:
    """Train with TRL's RewardTrainer as the spec says; write per-step records to <out>/steps.json."""
    spec = json.loads(spec_path.read_text())
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    rows = harness.read_jsonl(spec["dataset"])
    micro_batch = spec.get("micro_batch", TRL_MICRO_BATCH)  # pairs
    args = RewardConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, save_strategy="no",
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=spec["pairs_per_step"] // micro_batch,
        max_steps=spec["steps"], max_length=spec["max_length"], learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant", gradient_checkpointing=False, train_sampling_strategy="sequential",
        seed=spec["seed"],
    )
    assert RewardConfig.per_device_train_batch_size == TRL_MICRO_BATCH and args.pad_to_multiple_of is None
    assert args.center_rewards_coefficient is None and args.weight_decay == 0 and args.max_grad_norm == 1.0
    # the model as a path: TRL loads it itself (AutoModelForSequenceClassification, fp32, the saved head kept)
    trainer = RewardTrainer(model=spec["model"], args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer)
    if len(trainer.train_dataset) != len(rows):
        raise RuntimeError(f"TRL kept {len(trainer.train_dataset)} of {len(rows)} pairs at max_length "
                           f"{spec['max_length']}: every pair must fit")
    steps = harness.record_trl_steps(trainer, describe_micro_batch)
    trainer.train()
    result = {"steps": [step_record(step) for step in steps],
              "attn_implementation": trainer.model.config._attn_implementation}
    (Path(spec["out"]) / "steps.json").write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the parent: data, models, runs


def save_reward_model(causal_lm: Path, folder: Path, seed: int) -> dict:
    """``causal_lm`` as a one-label sequence classifier with a seeded value head, saved with its tokenizer.

    Both frameworks load this folder and keep its head (each would draw a new head its own way from a causal
    LM). Returns the parameter counts the docs quote.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(causal_lm)
    model = AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    width = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=generator) / width**0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    layer_matmuls = sum(m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "embedding": model.get_input_embeddings().weight.numel(), "layer_matmul_weights": layer_matmuls}


def prepare(args, work: Path) -> dict:
    """The reward model, the pairs (openpack's file order, and TRL's copy in openpack's step order), the plan."""
    pairs = args.pairs_per_step * args.steps
    lengths = harness.scaled_lengths(pairs, args.scale, args.seed)
    rows = harness.preference_rows(lengths, args.seed)
    row_cap = harness.ROW_CAP // args.scale
    model = ModelSpec(args.vocab, args.hidden, args.intermediate, args.layers, max_position_embeddings=2 * row_cap)
    (causal_lm,) = harness.save_models(work, model, seeds=[0])
    reward_model = work / "reward_seed0"
    counts = save_reward_model(causal_lm, reward_model, args.seed)
    # openpack shuffles the pairs into steps with its seed; TRL reads them sequentially in that order
    steps = epoch_steps(pairs, args.pairs_per_step, args.seed, 0)
    order = [i for step in steps for i in step]
    return {
        "work": work, "reward_model": reward_model, "model": model, "counts": counts, "lengths": lengths,
        "row_cap": row_cap, "max_tokens": OPENPACK_DEFAULT_CAP // args.scale, "steps": steps,
        "openpack_data": harness.write_jsonl(work / "pairs.jsonl", rows),
        "trl_data": harness.write_jsonl(work / "pairs_in_step_order.jsonl", [rows[i] for i in order]),
    }


def model_description(setup: dict) -> str:
    spec, counts = setup["model"], setup["counts"]
    return (f"Llama, {spec.num_hidden_layers} layers, width {spec.hidden_size}, MLP {spec.intermediate_size}, "
            f"4 query / 2 KV heads, vocab {spec.vocab_size} (the tokenizer uses 46 of them), the DPO benchmark's "
            f"model with a one-output value head (`score`) in place of its LM head; "
            f"{counts['parameters'] / 1e6:.1f}M parameters, {counts['embedding'] / 1e6:.1f}M of them the "
            "embedding (a lookup: no matmul)")


def openpack_command(args, setup: dict, save_path: Path) -> list[str]:
    return [
        "-m", "openpack.cli.main", "train_rm", "--launcher", "local",
        "--pretrain", str(setup["reward_model"]), "--dataset", str(setup["openpack_data"]),
        "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", str(setup["max_tokens"]),
        "--max_len", str(setup["row_cap"]), "--train_batch_size", str(args.pairs_per_step),
        "--max_steps", str(args.steps), "--learning_rate", str(args.learning_rate), "--lr_scheduler", "constant",
        "--lr_warmup_ratio", "0", "--adam_betas", "0.9", "0.999", "--max_norm", "1.0", "--loss", "sigmoid",
        "--seed", str(args.seed), "--save_path", str(save_path),
    ]


def run_openpack(args, setup: dict, run_dir: Path, env: dict) -> dict:
    measured = harness.run_measured(openpack_command(args, setup, run_dir), run_dir.with_suffix(".log"), env)
    harness.check_run(measured, "openpack train_rm")
    keep = ("loss", "pairs", "tokens", "micro_batches", "packing_efficiency", "step_time_s")
    steps = [{k: s[k] for k in keep} for s in harness.read_jsonl(run_dir / "metrics.jsonl") if "loss" in s]
    return {"steps": steps, "peak_rss_mb": measured.peak_rss_mb, "wall_s": measured.wall_s}


def run_trl(args, setup: dict, run_dir: Path, env: dict) -> dict:
    spec = {"model": str(setup["reward_model"]), "dataset": str(setup["trl_data"]),
            "pairs_per_step": args.pairs_per_step, "steps": args.steps, "max_length": setup["row_cap"],
            "learning_rate": args.learning_rate, "seed": args.seed}
    return harness.run_trl_worker(__file__, spec, run_dir, env, "TRL RewardTrainer worker")


def run_all(args, setup: dict, work: Path) -> list[dict]:
    # offline: TRL's trainer would otherwise try to send telemetry (this machine has no network)
    env = {**harness.subprocess_env(args.threads), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return harness.run_interleaved({
        "openpack": lambda repeat: run_openpack(args, setup, work / f"openpack_{repeat}", env),
        "TRL": lambda repeat: run_trl(args, setup, work / f"trl_{repeat}", env),
    }, args.repeats)


# ---------------------------------------------------------------- summary


def attention_scores(setup: dict, steps: list[int]) -> dict:
    """Query-key pairs each framework's attention evaluates in these steps: the sum of segment length squared
    for openpack's per-segment attention, rows x longest row squared for each padded TRL micro-batch."""
    rows = setup["lengths"].dpo_rows()  # (pairs, 2): [prompt + chosen, prompt + rejected]
    ours = trl = 0
    for s in steps:
        ids = setup["steps"][s]
        ours += int((rows[ids] ** 2).sum())
        for start in range(0, len(ids), TRL_MICRO_BATCH):
            micro = rows[ids[start:start + TRL_MICRO_BATCH]]
            trl += micro.size * int(micro.max()) ** 2
    return {"openpack": ours, "TRL": trl}


def forward_flops(setup: dict, computed_per_real: float, scores_per_real: float) -> dict:
    """Decoder matmul FLOPs of one forward per real token: the layers' weights on every computed token (padding
    included), and QK^T plus AV on every query-key pair (4 x width each); the backward is twice both."""
    spec = setup["model"]
    linear = 2 * setup["counts"]["layer_matmul_weights"] * computed_per_real * spec.num_hidden_layers
    attention = 4 * spec.hidden_size * scores_per_real * spec.num_hidden_layers
    return {"linear": linear, "attention": attention, "total": linear + attention}


def summarise(runs: list[dict], setup: dict) -> dict:
    ours = [r for r in runs if r["arm"] == "openpack"]
    trl = [r for r in runs if r["arm"] == "TRL"]
    measured = list(range(1, len(trl[0]["steps"]))) or [0]
    work = step_work(setup, measured)
    for run in runs:  # the same pairs in every step, so the same real tokens
        if sum(run["steps"][s]["tokens"] for s in measured) != work["real"]:
            raise RuntimeError(f"{run['arm']} repeat {run['repeat']} did not train on the planned pairs: has "
                               "openpack's step order (core/schedule.epoch_steps) changed?")
    keys = ("tokens_per_s", "pairs_per_s", "step_time_s", "peak_rss_mb")
    summary = {key: harness.by_arm(runs, key) for key in keys}
    scores = attention_scores(setup, measured)
    computed = {"openpack": 1.0, "TRL": sum(trl[0]["steps"][s]["slots"] for s in measured) / work["real"]}

    def per_forward(run: dict, key: str) -> float:
        return sum(run["steps"][s][key] for s in measured) / sum(run["steps"][s]["micro_batches"] for s in measured)

    summary.update(
        speedup=[o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, trl)],
        memory_ratio=[t["peak_rss_mb"] / o["peak_rss_mb"] for o, t in zip(ours, trl)],
        first_step_loss={"openpack": [r["steps"][0]["loss"] for r in ours],
                         "TRL": [r["steps"][0]["loss"] for r in trl]},
        first_step_loss_diff=[abs(o["steps"][0]["loss"] - t["steps"][0]["loss"]) for o, t in zip(ours, trl)],
        max_step_loss_diff=[max(abs(a["loss"] - b["loss"]) for a, b in zip(o["steps"], t["steps"]))
                            for o, t in zip(ours, trl)],
        trl_computed_per_real=computed["TRL"],
        scores_per_real={arm: scores[arm] / work["real"] for arm in ARMS},
        forward_flops_per_real={arm: forward_flops(setup, computed[arm], scores[arm] / work["real"]) for arm in ARMS},
        # what one forward holds: a packed row's tokens, or a padded micro-batch's slots (rows x longest)
        tokens_per_forward={"openpack": per_forward(ours[0], "tokens"), "TRL": per_forward(trl[0], "slots")},
        micro_batches={"openpack": mean_over(ours[0], "micro_batches", measured),
                       "TRL": mean_over(trl[0], "micro_batches", measured)},
        packing_efficiency=mean_over(ours[0], "packing_efficiency", measured),
        real_tokens_per_step=work["real"] / len(measured),
        attn_implementation=trl[0]["attn_implementation"],
    )
    return summary


def results_table(s: dict) -> str:
    lines = [
        ("| framework | real tokens/s | pairs/s | s / optimizer step | micro-batches / step | computed / real "
         "tokens | attention scores / real token | peak RSS (MiB) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    computed = {"openpack": 1.0, "TRL": s["trl_computed_per_real"]}  # openpack computes its real tokens only
    for arm in ARMS:
        lines.append(
            f"| {arm} | {harness.fmt_spread(s['tokens_per_s'][arm])} "
            f"| {harness.fmt_spread(s['pairs_per_s'][arm], '{:.2f}')} "
            f"| {harness.fmt_spread(s['step_time_s'][arm], '{:.2f}')} | {s['micro_batches'][arm]:.1f} "
            f"| {computed[arm]:.2f} | {s['scores_per_real'][arm]:.0f} "
            f"| {harness.fmt_spread(s['peak_rss_mb'][arm])} |")
    speedup = harness.fmt_spread(s["speedup"], "{:.2f}x")
    lines.append(f"| **openpack / TRL** | **{speedup}** | {speedup} | {speedup} faster | | | "
                 f"| {harness.fmt_spread(s['memory_ratio'], '{:.2f}x')} less |")
    return "\n".join(lines)


def loss_check(s: dict) -> str:
    ours, trl = s["first_step_loss"]["openpack"], s["first_step_loss"]["TRL"]
    return (f"Step-1 loss (same weights, value head and first batch): openpack {ours[0]:.6f}, TRL {trl[0]:.6f}, "
            f"|difference| {max(s['first_step_loss_diff']):.1e} (largest over repeats); the largest per-step "
            f"difference over whole runs is {max(s['max_step_loss_diff']):.1e}")


def threads_text(threads: int) -> str:
    return f"{threads} torch thread{'s' if threads != 1 else ''}"


def setup_text(args, setup: dict, s: dict) -> str:
    return (
        f"Model: {model_description(setup)}; fp32. Data: {args.pairs_per_step * args.steps} pairs "
        f"({args.steps} steps of {args.pairs_per_step}), seed {args.seed}, "
        f"{harness.scaled_mix_description(args.scale)} (**scale factor {args.scale}**: rows <= "
        f"{setup['row_cap']} tokens; {s['real_tokens_per_step']:.0f} real tokens per measured step). Both: max length {setup['row_cap']} per "
        f"sequence (nothing dropped or truncated), {args.pairs_per_step} pairs per optimizer step, "
        f"-log sigmoid(r_chosen - r_rejected) averaged over the step's pairs, no margin, no centering, lr "
        f"{args.learning_rate:g} (TRL's default) constant, AdamW (0.9, 0.999), no weight decay, clip 1.0, no "
        f"gradient checkpointing, the value head saved with the model (std 1/sqrt({setup['model'].hidden_size}), so "
        f"rewards spread over about one unit), {threads_text(args.threads)} per arm. openpack: `--max_tokens_per_gpu "
        f"{setup['max_tokens']}` (its default 16384 / {args.scale}), `--zero_stage 2` (its default; one CPU rank "
        "runs it as stage 0), attention per segment. "
        f"TRL: `RewardConfig(use_cpu=True, bf16=False, gradient_checkpointing=False, gradient_accumulation_steps="
        f"{args.pairs_per_step // TRL_MICRO_BATCH}, lr_scheduler_type=\"constant\", train_sampling_strategy="
        f"\"sequential\", ...)` (bf16 and gradient checkpointing are its defaults: the first has no place in an "
        f"fp32 comparison, and openpack runs without the second), {TRL_MICRO_BATCH} pairs per right-padded "
        f"micro-batch (its default), its own collator, `{s['attn_implementation']}` attention with a padding mask "
        f"(its default on CPU). Step 1 of every run is warm-up and not counted."
    )


def markdown_section(args, setup: dict, s: dict, chart: Path | None, doc: Path, wall_s: float) -> str:
    image = f"![reward-model tokens/s and peak memory]({os.path.relpath(chart, doc.parent)})\n\n" if chart else ""
    cmd = harness.shell_command(openpack_command(args, setup, setup["work"] / "RUN_DIR"))
    cmd = cmd.replace(f"{setup['work']}/", "")  # paths relative to the work folder
    return f"""## Reward models: openpack vs TRL RewardTrainer (`benchmarks/rm_vs_trl.py`)

```
{args.command}
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s. The machine was shared with other
work; each framework ran {args.repeats}x, interleaved, and every cell is median (min-max) over repeats
(ratios are taken per repeat pair).

{setup_text(args, setup, s)} The openpack command (paths relative to the work folder):

```
{cmd}
```

{results_table(s)}

{loss_check(s)}.

{image}{explanation(setup, s, args.threads)}
"""


def explanation(setup: dict, s: dict, threads: int) -> str:
    """What the measured ratios come from; the numbers are this run's."""
    step = {arm: harness.spread(s["step_time_s"][arm])[1] for arm in ARMS}
    padding, scores, flops = s["trl_computed_per_real"], s["scores_per_real"], s["forward_flops_per_real"]
    flops_ratio = flops["TRL"]["total"] / flops["openpack"]["total"]
    speedup, memory = harness.spread(s["speedup"])[1], harness.spread(s["memory_ratio"])[1]
    counts, per_forward = setup["counts"], s["tokens_per_forward"]
    return f"""**Why openpack is faster on this CPU: {speedup:.2f}x.** Unlike DPO and SFT, no LM head is involved: a
reward model's head is one number per position (TRL's sequence classifier computes it at every position and keeps
the last real one, openpack only at each segment's last token), a negligible matmul either way, so the CPU-only
head gap of those sections does not arise here. What is left is padding. TRL pads the chosen and rejected rows of
{TRL_MICRO_BATCH} pairs to the longest of their {2 * TRL_MICRO_BATCH}, so its decoder computes {padding:.2f}x the
real tokens of the measured steps (over 20000 pairs of this mix it is 2.43x, as ANCHORS states); openpack computes
each real token once, in {s['micro_batches']['openpack']:.1f} packed rows per step
({100 * s['packing_efficiency']:.0f}% of the {setup['max_tokens']}-token cap). Attention is quadratic in length, so
it is skewed further: TRL's padded SDPA has {scores['TRL']:.0f} query-key pairs per real token in its score
matrices, openpack's per-segment attention {scores['openpack']:.0f}. Together, TRL's decoder does
{flops_ratio:.2f}x openpack's matmul FLOPs per real token ({100 * flops['TRL']['linear'] / flops['TRL']['total']:.0f}%
of TRL's in the linear layers at these lengths). The measured speed-up is {100 * speedup / flops_ratio:.0f}% of that:
what does not shrink with padding takes its share of every step, and a reward step is small (one model, no
reference, no LM head): the AdamW update of all {counts['parameters'] / 1e6:.1f}M parameters (the
{counts['embedding'] / 1e6:.1f}M-parameter embedding gets a dense gradient in both, though only 46 of its rows are
used) and each framework's own cost per step (both step timers include collation).

**Memory: {memory:.2f}x less.** With no vocab-sized logits on either side, what differs is activations, and
they follow what one forward holds: {per_forward['openpack']:.0f} real tokens in openpack (a packed row, at most
{setup['max_tokens']}) against {per_forward['TRL']:.0f} token slots in TRL ({TRL_MICRO_BATCH} padded pairs, up to
{2 * TRL_MICRO_BATCH} x {setup['row_cap']} here), {per_forward['TRL'] / per_forward['openpack']:.1f}x on average. The
rest of each peak (Python, torch and the libraries: DeepSpeed for openpack, accelerate and datasets for TRL; the
weights and the AdamW state) does not shrink with padding, so the peak ratio is smaller than that.

**One thread per arm, unlike the DPO and SFT sections (2 threads), so tokens/s do not compare across them.** When
this section was first written, with another engineer's training holding one of the 2 cores, the same comparison
(5 steps, 3 repeats) at 2 threads per arm took 8.6-10.2 s per step for openpack and 8.1-10.8 s for TRL (openpack /
TRL 0.95-1.10x): two intra-op threads stall at every parallel region while a core is taken, so the stalls, not the
frameworks, were measured. This run used {threads_text(threads)} per arm: a step took {step['openpack']:.1f} s in
openpack and {step['TRL']:.1f} s in TRL (medians). On an idle machine 2 threads would shorten both arms; that was
not measured.

**What carries over to a GPU.** The padding does: about 2.43x in tokens on this mix at 8 pairs per micro-batch
({padding:.2f}x in this run's small sample), less in time, since the optimizer step and fixed costs do not shrink. With flash-attn, transformers unpads inside
attention, so the attention gap closes there, but TRL's linear layers still run on the padding: `RewardConfig`
has no padding-free mode. Neither side computes the shared prompt once for chosen and rejected (ANCHORS: a
further 22.6% of the tokens). So on a GPU the token ratio is the ceiling, and fixed costs per step keep the
speed-up under it, less so for a larger model, whose work per token grows faster than those costs."""


def charts(path: Path, s: dict) -> None:
    harness.speed_and_memory_charts(path, s, ARMS, "reward model",
                                    "Reward model on CPU: openpack vs TRL 1.16 RewardTrainer")


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, trl_worker, "rm_vs_trl_")


def benchmark(args, work: Path) -> int:
    """Run every arm in ``work``, print the tables, write results.json there and the docs section."""
    started = time.perf_counter()
    setup = prepare(args, work)
    print(f"model: {model_description(setup)}")
    print(f"data: {args.pairs_per_step * args.steps} pairs, scale factor {args.scale} (rows <= {setup['row_cap']} "
          f"tokens); work folder {work}")
    print("openpack:", harness.shell_command(openpack_command(args, setup, work / "openpack_<repeat>")))
    runs = run_all(args, setup, work)
    summary = summarise(runs, setup)
    wall_s = time.perf_counter() - started
    print(results_table(summary))
    print(loss_check(summary))
    print(f"TRL computes {summary['trl_computed_per_real']:.2f}x the real tokens; total wall time {wall_s:.0f} s")
    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "scale": args.scale, "runs": runs, "summary": summary, "wall_s": wall_s}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.markdown is not None:
        charts(args.chart, summary)
        harness.write_section(args.markdown, SECTION, markdown_section(args, setup, summary, args.chart,
                                                                        args.markdown, wall_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
