"""SFT on CPU: openpack (packed rows, token-budget micro-batches) vs TRL 1.16's SFTTrainer, packed and padded.

    python benchmarks/sft_vs_trl.py [--repeats 2] [--steps 3] [--scale 4] [--markdown docs/benchmarks.md]
    python benchmarks/sft_vs_trl.py --smoke --out /tmp/x     # seconds-long check of the harness (CI)

Three arms, each run in a fresh subprocess, interleaved (openpack, TRL
packed, TRL padded, openpack, ...), on the same saved model (a small
random-init Llama, fp32) and the same rows: prompt + chosen of the ANCHORS
length mix divided by ``--scale``, the loss on the completion and its eos.

* openpack: ``openpack train_sft --packing_samples --use_dynamic_batch
  --max_tokens_per_gpu N --launcher local``: rows of <= N tokens, attention
  per segment, the LM head applied to label tokens only.
* TRL packed: ``SFTConfig(packing=True)``, whose default strategy ``bfd``
  turns on ``padding_free``: 8 packs of ``max_length`` tokens per micro-batch
  (TRL's default batch size) flattened into one row whose ``position_ids``
  restart at every sequence, no attention mask. Without flash-attn (CPU) the
  model runs SDPA and transformers rebuilds a block-diagonal causal mask from
  the position resets (TRL passes ``use_cache=False``; with a cache the
  detection is off), so sequences are isolated, which the worker checks on
  one pack, but the kernel scores the whole T x T row.
* TRL padded: ``packing=False``: 8 rows per micro-batch padded to the longest.

openpack and TRL padded read the same rows in the same step order (TRL's
sequential sampler over rows written in openpack's order), so their step-1
losses must agree. TRL packed trains on its own packs (the rows repeated so
that every step gets full micro-batches) with its default random sampler, at
gradient accumulation 1 or more: a step holds at least 8 packs. Gradient
checkpointing is off in every arm (TRL's default is on).

Reported over the steps after the first (warm-up): real tokens/s, samples/s,
seconds per optimizer step, peak resident memory per process, and openpack /
TRL as median (min-max) over repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import ModelSpec

from openpack.core.schedule import epoch_steps

TRL_MICRO_BATCH = 8  # TRL's default per_device_train_batch_size (checked in the worker; a spec's micro_batch overrides)
OPENPACK_DEFAULT_CAP = 16384  # openpack's default --max_tokens_per_gpu, divided by --scale like the lengths
ARMS = ("openpack", "TRL packed", "TRL padded")
SECTION = "sft_vs_trl"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples_per_step", type=int, default=16, help="rows per optimizer step (multiple of 8)")
    harness.add_run_args(parser, SECTION, learning_rate=2e-5)  # TRL SFT's default learning rate
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples_per_step = 16
        harness.apply_smoke(args)
    args.markdown, args.chart = harness.docs_outputs(args.markdown, args.chart, SECTION, args.smoke)
    if args.samples_per_step % TRL_MICRO_BATCH:
        parser.error(f"--samples_per_step must be a multiple of TRL's micro-batch of {TRL_MICRO_BATCH} rows")
    return args


# ---------------------------------------------------------------- TRL, in its own process


def describe_micro_batch(inputs, num_items_in_batch) -> dict:
    """Real tokens, computed slots, samples, label tokens and attention scores of one TRL SFT micro-batch."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    if "attention_mask" in inputs:  # padded: B rows of the longest row's length
        rows, length = ids.shape
        tokens, samples, scores = int(inputs["attention_mask"].sum()), rows, rows * length * length
    else:  # padding-free: one flattened row, sequences start where position_ids is 0
        tokens, samples = ids.numel(), int((inputs["position_ids"] == 0).sum())
        scores = ids.numel() ** 2  # SDPA with transformers' block mask scores the whole row
    return {"tokens": tokens, "slots": ids.numel(), "samples": samples, "scores": scores,
            "label_tokens": int((labels[:, 1:] != -100).sum()),
            "num_items": None if num_items_in_batch is None else int(num_items_in_batch)}


def step_record(step: dict) -> dict:
    """One optimizer step from its micro-batches: the loss as the token mean over the step's label tokens.

    With ``num_items_in_batch`` TRL divides each micro-batch's summed NLL by the
    step's label count; without it, by the micro-batch's own count.
    """
    micro = step["micro_batches"]
    nll = sum(m["loss"] * (m["num_items"] or m["label_tokens"]) for m in micro)
    labels = sum(m["label_tokens"] for m in micro)
    record = {key: sum(m[key] for m in micro) for key in ("tokens", "slots", "samples", "scores")}
    return {**record, "loss": nll / labels, "loss_tokens": labels, "micro_batches": len(micro),
            "step_time_s": step["step_time_s"]}


def isolation_error(model, collator, pack: dict) -> float:
    """Largest logit difference between one TRL pack run as its padding-free row and its sequences run alone.

    ~1e-6 means the sequences are isolated (transformers builds a block mask
    from the position resets); a leak between sequences shows as O(1).
    """
    import torch

    batch = collator([pack])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = [model(input_ids=ids[None], use_cache=False).logits[0]
                 for ids in batch["input_ids"][0].split(pack["seq_lengths"])]
    return (packed - torch.cat(alone)).abs().max().item()


def trl_worker(spec_path: Path) -> int:
    """Train with TRL's SFTTrainer as the spec says; write per-step records to <out>/steps.json."""
    spec = json.loads(spec_path.read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = harness.read_jsonl(spec["dataset"])
    args = SFTConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, save_strategy="no",
        packing=spec["packing"], max_length=spec["max_length"], gradient_accumulation_steps=spec["accumulation"],
        max_steps=spec["steps"], learning_rate=spec["learning_rate"], lr_scheduler_type="constant",
        gradient_checkpointing=False, seed=spec["seed"], per_device_train_batch_size=spec.get("micro_batch", TRL_MICRO_BATCH),
        train_sampling_strategy="random" if spec["packing"] else "sequential",
    )
    assert TRL_MICRO_BATCH == SFTConfig.per_device_train_batch_size and args.packing_strategy == "bfd"
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    assert trainer.padding_free == spec["packing"], "TRL's bfd packing should switch padding_free on"
    report = {"attn_implementation": model.config._attn_implementation}
    if spec["packing"]:
        report["isolation_max_diff"] = isolation_error(model, trainer.data_collator, trainer.train_dataset[0])
    steps = harness.record_trl_steps(trainer, describe_micro_batch)
    trainer.train()
    report["steps"] = [step_record(step) for step in steps]
    (Path(spec["out"]) / "steps.json").write_text(json.dumps(report))
    return 0


# ---------------------------------------------------------------- the parent: data, model, runs


def prepare(args, work: Path) -> dict:
    samples = args.samples_per_step * args.steps
    lengths = harness.scaled_lengths(samples, args.scale, args.seed)
    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in harness.preference_rows(lengths, args.seed)]
    row_cap = harness.ROW_CAP // args.scale
    spec = ModelSpec(args.vocab, args.hidden, args.intermediate, args.layers, max_position_embeddings=2 * row_cap)
    (model,) = harness.save_models(work, spec, seeds=[0])
    steps = epoch_steps(samples, args.samples_per_step, args.seed, 0)
    order = [i for step in steps for i in step]
    # TRL packed: micro-batches of 8 packs of row_cap tokens, as many as hold about a step's tokens (at
    # least one), and the rows repeated until every step gets full micro-batches
    tokens = int(lengths.sft_rows().sum())
    pack = TRL_MICRO_BATCH * row_cap
    accumulation = max(1, round(tokens / args.steps / pack))
    copies = math.ceil(1.1 * args.steps * accumulation * pack / tokens)  # bfd fills packs to ~99%
    return {
        "work": work, "model": model, "spec": spec, "lengths": lengths, "row_cap": row_cap, "steps": steps,
        "max_tokens": OPENPACK_DEFAULT_CAP // args.scale,
        "packed_accumulation": accumulation, "packed_copies": copies,
        "openpack_data": harness.write_jsonl(work / "sft.jsonl", rows),
        "trl_data": harness.write_jsonl(work / "sft_in_step_order.jsonl", [rows[i] for i in order]),
        "trl_packed_data": harness.write_jsonl(work / "sft_repeated.jsonl", rows * copies),
    }


def openpack_command(args, setup: dict, save_path: Path) -> list[str]:
    return [
        "-m", "openpack.cli.main", "train_sft", "--launcher", "local",
        "--pretrain", str(setup["model"]), "--dataset", str(setup["openpack_data"]),
        "--input_key", "prompt", "--output_key", "completion", "--input_template", "None",  # bare, as TRL's
        "--packing_samples", "--use_dynamic_batch",
        "--max_tokens_per_gpu", str(setup["max_tokens"]), "--max_len", str(setup["row_cap"]),
        "--train_batch_size", str(args.samples_per_step), "--max_steps", str(args.steps),
        "--learning_rate", str(args.learning_rate), "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
        "--adam_betas", "0.9", "0.999", "--max_norm", "1.0", "--seed", str(args.seed), "--save_path", str(save_path),
    ]


def run_openpack(args, setup: dict, run_dir: Path, env: dict) -> dict:
    cmd = openpack_command(args, setup, run_dir)
    measured = harness.run_measured(cmd, run_dir.with_suffix(".log"), env)
    harness.check_run(measured, "openpack train_sft")
    keep = ("loss", "samples", "tokens", "loss_tokens", "micro_batches", "packing_efficiency", "step_time_s")
    steps = [{k: s[k] for k in keep} for s in harness.read_jsonl(run_dir / "metrics.jsonl")]
    for step, ids in zip(steps, setup["steps"]):  # each segment attends over itself only
        step["scores"] = sum(int(setup["lengths"].sft_rows()[i]) ** 2 for i in ids)
    return {"steps": steps, "peak_rss_mb": measured.peak_rss_mb, "wall_s": measured.wall_s}


def run_trl(args, setup: dict, run_dir: Path, env: dict, packing: bool) -> dict:
    dataset = setup["trl_packed_data"] if packing else setup["trl_data"]
    spec = {"model": str(setup["model"]), "dataset": str(dataset),
            "packing": packing, "max_length": setup["row_cap"], "steps": args.steps,
            "accumulation": setup["packed_accumulation"] if packing else args.samples_per_step // TRL_MICRO_BATCH,
            "learning_rate": args.learning_rate, "seed": args.seed}
    return harness.run_trl_worker(__file__, spec, run_dir, env, f"TRL SFTTrainer worker (packing={packing})")


def run_all(args, setup: dict, work: Path) -> list[dict]:
    env = harness.subprocess_env(args.threads)
    return harness.run_interleaved({
        "openpack": lambda repeat: run_openpack(args, setup, work / f"openpack_{repeat}", env),
        "TRL packed": lambda repeat: run_trl(args, setup, work / f"trl_packed_{repeat}", env, packing=True),
        "TRL padded": lambda repeat: run_trl(args, setup, work / f"trl_padded_{repeat}", env, packing=False),
    }, args.repeats)


# ---------------------------------------------------------------- summary


def per_step_mean(run: dict, key: str) -> float:
    measured = run["steps"][1:] or run["steps"]
    return sum(s[key] for s in measured) / len(measured)


def summarise(runs: list[dict]) -> dict:
    first = {arm: next(r for r in runs if r["arm"] == arm) for arm in ARMS}
    ours = [r for r in runs if r["arm"] == "openpack"]
    summary = {key: harness.by_arm(runs, key) for key in ("tokens_per_s", "samples_per_s", "step_time_s",
                                                           "peak_rss_mb")}
    for arm, name in (("TRL packed", "packed"), ("TRL padded", "padded")):
        theirs = [r for r in runs if r["arm"] == arm]
        summary[f"speedup_vs_{name}"] = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, theirs)]
        summary[f"memory_ratio_vs_{name}"] = [t["peak_rss_mb"] / o["peak_rss_mb"] for o, t in zip(ours, theirs)]
    padded = [r for r in runs if r["arm"] == "TRL padded"]
    summary["first_step_loss"] = {"openpack": [r["steps"][0]["loss"] for r in ours],
                                  "TRL padded": [r["steps"][0]["loss"] for r in padded]}
    summary["first_step_loss_diff"] = [abs(o["steps"][0]["loss"] - t["steps"][0]["loss"])
                                       for o, t in zip(ours, padded)]
    summary["per_arm"] = {arm: {
        "tokens_per_step": per_step_mean(run, "tokens"),
        "micro_batches": per_step_mean(run, "micro_batches"),
        # openpack computes exactly its real tokens (no padding, no "slots" to count)
        "computed_per_real": per_step_mean(run, "slots") / per_step_mean(run, "tokens") if arm != "openpack" else 1.0,
        "scores_per_real": per_step_mean(run, "scores") / per_step_mean(run, "tokens"),
        "label_share": per_step_mean(run, "loss_tokens") / per_step_mean(run, "tokens"),
    } for arm, run in first.items()}
    summary["attn_implementation"] = first["TRL packed"]["attn_implementation"]
    summary["isolation_max_diff"] = max(r["isolation_max_diff"] for r in runs if r["arm"] == "TRL packed")
    return summary


def results_table(s: dict) -> str:
    lines = [
        ("| arm | real tokens/s | samples/s | s / optimizer step | real tokens / step | computed / real tokens "
         "| attention scores / real token | peak RSS (MiB) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in ARMS:
        p = s["per_arm"][arm]
        lines.append(
            f"| {arm} | {harness.fmt_spread(s['tokens_per_s'][arm])} "
            f"| {harness.fmt_spread(s['samples_per_s'][arm], '{:.2f}')} "
            f"| {harness.fmt_spread(s['step_time_s'][arm], '{:.2f}')} | {p['tokens_per_step']:.0f} "
            f"| {p['computed_per_real']:.2f} | {p['scores_per_real']:.0f} "
            f"| {harness.fmt_spread(s['peak_rss_mb'][arm])} |")
    for name in ("packed", "padded"):
        lines.append(f"| **openpack / TRL {name}** | **{harness.fmt_spread(s[f'speedup_vs_{name}'], '{:.2f}x')}** "
                     "| | | | | | "
                     f"{harness.fmt_spread(s[f'memory_ratio_vs_{name}'], '{:.2f}x')} less |")
    return "\n".join(lines)


def loss_check(s: dict) -> str:
    ours, theirs = s["first_step_loss"]["openpack"], s["first_step_loss"]["TRL padded"]
    return (f"Step-1 loss, openpack vs TRL padded (same weights, same rows): {ours[0]:.6f} vs {theirs[0]:.6f}, "
            f"|difference| {max(s['first_step_loss_diff']):.1e}")


def setup_text(args, setup: dict) -> str:
    n = args.samples_per_step * args.steps
    return (
        f"Model: {setup['spec'].describe()}; fp32. Data: {n} rows (prompt + chosen), seed {args.seed}, "
        f"{harness.scaled_mix_description(args.scale)} (scale factor {args.scale}: rows <= {setup['row_cap']} "
        f"tokens). All arms: max length {setup['row_cap']} (nothing truncated), lr {args.learning_rate:g} "
        f"constant, AdamW (0.9, 0.999), clip 1.0, loss on completion + eos, no gradient checkpointing, "
        f"{args.threads} threads. openpack: `--train_batch_size {args.samples_per_step} --max_tokens_per_gpu "
        f"{setup['max_tokens']}` (its default 16384 / {args.scale}). TRL padded: 8 rows per micro-batch x "
        f"{args.samples_per_step // TRL_MICRO_BATCH} accumulation = {args.samples_per_step} rows per step. TRL "
        f"packed: `packing=True` (bfd, padding-free), 8 packs of {setup['row_cap']} tokens per micro-batch x "
        f"{setup['packed_accumulation']} accumulation. Step 1 of each run is warm-up and not counted."
    )


def markdown_section(args, setup: dict, s: dict, chart: Path | None, doc: Path, wall_s: float) -> str:
    image = f"![SFT tokens/s and peak memory]({os.path.relpath(chart, doc.parent)})\n\n" if chart else ""
    packed, padded, ours = s["per_arm"]["TRL packed"], s["per_arm"]["TRL padded"], s["per_arm"]["openpack"]
    row = TRL_MICRO_BATCH * setup["row_cap"]
    cmd = harness.shell_command(openpack_command(args, setup, setup["work"] / "RUN_DIR"))
    cmd = cmd.replace(f"{setup['work']}/", "")  # paths relative to the work folder
    return f"""## SFT: openpack vs TRL SFTTrainer, packed and padded (`benchmarks/sft_vs_trl.py`)

```
python benchmarks/sft_vs_trl.py
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s. The machine was shared with other
work; each arm ran {args.repeats}x, interleaved, and every cell is median (min-max) over repeats (ratios per
repeat).

{setup_text(args, setup)} The openpack command (paths relative to the work folder):

```
{cmd}
```

{results_table(s)}

{loss_check(s)}. "Attention scores" are the query-key pairs the attention kernel evaluates per real token:
segment length squared for openpack's per-segment SDPA, batch x longest row squared for TRL padded, row
length squared for TRL packed.

{image}**What TRL 1.16's SFT packing does on CPU.** `packing=True` packs rows best-fit-decreasing into
`max_length` packs (inside each 1000-row block of `datasets.map`; see the packing section) and, with the
default `bfd` strategy, turns on `padding_free`: a micro-batch of 8 packs becomes one {row}-token row with
`position_ids` restarting at every sequence and no attention mask. Without flash-attn the model runs
`{s['attn_implementation']}`, and transformers detects the position resets (only when there is no attention
mask and no KV cache; TRL passes `use_cache=False`) and builds a block-diagonal causal mask. Sequences are
therefore isolated: one pack run as its padding-free row and its sequences run alone differ by at most
{s['isolation_max_diff']:.1e} in the logits. The cost is that SDPA with an explicit mask evaluates the whole
row, {packed['scores_per_real']:.0f} scores per real token against {ours['scores_per_real']:.0f} for openpack's
per-segment attention and {padded['scores_per_real']:.0f} for TRL padded. On a GPU with flash-attn, TRL hands
`cu_seq_lens` to the varlen kernel and this cost goes away.

**Where openpack wins, and where it does not.** Against TRL padded, openpack computes
1/{padded['computed_per_real']:.2f} of the tokens (no padding). Against both TRL arms, TRL's fused log-prob
head projects *every* position of a micro-batch through the {setup['spec'].vocab_size}-token vocab on CPU (it
scores only labelled positions on CUDA/XPU), while openpack projects only label tokens
({ours['label_share']:.2f} of the real tokens here, the completions), and on this small model the head is most
of the matmul work. Against TRL packed, the whole-row attention above adds to that. Both of these gaps are
CPU-only: on a GPU with flash-attn, TRL packed computes the same tokens as openpack with varlen attention and
a compact head, and what is left is packing efficiency (about 0.5%, see the packing section) and fixed costs
per step, so expect parity there, not {harness.spread(s['speedup_vs_packed'])[1]:.1f}x. openpack's own CPU
attention kernel is about as fast as plain per-segment SDPA (see the DPO section). Memory: TRL's CPU head allocates min(positions, 4096) x 32768 fp32 tiles (512 MiB each, several
alive in the backward), which is why TRL packed (4096-token micro-batches) peaks higher than TRL padded;
openpack's head chunk is 2^26 logits (256 MiB) and its activations are for one row of at most
{setup['max_tokens']} tokens.
"""


def charts(path: Path, s: dict) -> None:
    harness.speed_and_memory_charts(path, s, ARMS, "SFT", "SFT on CPU: openpack vs TRL 1.16 SFTTrainer")


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, trl_worker, "sft_vs_trl_")


def benchmark(args, work: Path) -> int:
    """Run every arm in ``work``, print the tables, write results.json there and the docs section."""
    started = time.perf_counter()
    setup = prepare(args, work)
    print(f"model: {setup['spec'].describe()}")
    print(f"data: {args.samples_per_step * args.steps} rows, scale factor {args.scale} "
          f"(rows <= {setup['row_cap']} tokens); work folder {work}")
    print("openpack command:", harness.shell_command(openpack_command(args, setup, work / "openpack_<repeat>")))
    runs = run_all(args, setup, work)
    summary = summarise(runs)
    wall_s = time.perf_counter() - started
    print(results_table(summary))
    print(loss_check(summary))
    print(f"total wall time {wall_s:.0f} s")
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
