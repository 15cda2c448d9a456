"""DPO on CPU: openpack (packed pairs, token-budget micro-batches) vs TRL 1.16's DPOTrainer (padded batches).

    python benchmarks/dpo_vs_trl.py [--repeats 2] [--steps 3] [--scale 4] [--markdown docs/benchmarks.md]
    python benchmarks/dpo_vs_trl.py --smoke --out /tmp/x     # seconds-long check of the harness (CI)

Both frameworks train the same saved model (a small random-init Llama, fp32)
against the same saved reference (another seed, so the step-1 loss is not the
trivial ln 2), on the same preference pairs in the same order, with the same
pairs per optimizer step, max length and hyperparameters (sigmoid loss, beta,
lr, constant schedule, AdamW betas, clipping). Each run is a fresh
subprocess; runs alternate openpack, TRL, openpack, TRL...

* openpack: ``openpack train_dpo --packing_samples --use_dynamic_batch
  --max_tokens_per_gpu N --launcher local``: a pair's two sequences are
  segments of a packed row of <= N tokens; nothing is padded.
* TRL: ``DPOTrainer`` with its defaults (8 pairs per micro-batch, chosen and
  rejected padded to the longest of the 16 rows) and gradient accumulation so
  a step has the same pairs. Two settings differ from TRL's defaults, neither
  favouring openpack: gradient checkpointing is off (TRL's default is on,
  openpack's off: both run without it), and TRL's sampler is sequential over
  the pairs written in openpack's step order, so every step of both runs holds
  the same pairs and their per-step losses must agree.

Reported over the steps after the first (warm-up): real (non-padding)
tokens/s, pairs/s and seconds per optimizer step from each framework's own
step timer; each process's peak resident memory; and openpack / TRL per
repeat, as median (min-max). Lengths are the ANCHORS mix divided by
``--scale`` (stated in the output) so that a run fits the CPU budget. Also
timed in-process: one layer's attention over openpack's first packed row,
through openpack's CPU kernel and through plain SDPA on each segment's slice.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import ModelSpec

from openpack.core.packing import plan_packs
from openpack.core.schedule import epoch_steps

TRL_MICRO_BATCH = 8  # TRL's default per_device_train_batch_size (checked in the worker; a spec's micro_batch overrides)
OPENPACK_DEFAULT_CAP = 16384  # openpack's default --max_tokens_per_gpu, divided by --scale like the lengths
ARMS = ("openpack", "TRL")
SECTION = "dpo_vs_trl"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs_per_step", type=int, default=16, help="pairs per optimizer step (a multiple of 8)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (sigmoid loss)")
    harness.add_run_args(parser, SECTION, learning_rate=5e-6)
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs_per_step = 8
        harness.apply_smoke(args)
    args.markdown, args.chart = harness.docs_outputs(args.markdown, args.chart, SECTION, args.smoke)
    if args.pairs_per_step % TRL_MICRO_BATCH:
        parser.error(f"--pairs_per_step must be a multiple of TRL's micro-batch of {TRL_MICRO_BATCH} pairs")
    return args


# ---------------------------------------------------------------- TRL, in its own process


def describe_micro_batch(inputs, _num_items_in_batch) -> dict:
    """Real tokens, computed slots and pairs of one TRL micro-batch: rows [chosen..., rejected...]."""
    mask = inputs["attention_mask"]
    return {"tokens": int(mask.sum()), "slots": mask.numel(), "pairs": mask.shape[0] // 2}


def step_record(step: dict) -> dict:
    """One optimizer step from its micro-batches; TRL's loss is a micro-batch's mean over its pairs."""
    micro = step["micro_batches"]
    pairs = sum(m["pairs"] for m in micro)
    return {"loss": sum(m["loss"] * m["pairs"] for m in micro) / pairs, "pairs": pairs,
            "tokens": sum(m["tokens"] for m in micro), "slots": sum(m["slots"] for m in micro),
            "micro_batches": len(micro), "step_time_s": step["step_time_s"]}


def trl_worker(spec_path: Path) -> int:
    """Train with TRL's DPOTrainer as the spec says; write per-step records to <out>/steps.json."""
    spec = json.loads(spec_path.read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["policy"])
    policy = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(spec["reference"], dtype=torch.float32)
    rows = [json.loads(line) for line in Path(spec["dataset"]).read_text().splitlines()]
    micro_batch = spec.get("micro_batch", TRL_MICRO_BATCH)  # pairs
    args = DPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, save_strategy="no",
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=spec["pairs_per_step"] // micro_batch,
        max_steps=spec["steps"], max_length=spec["max_length"], learning_rate=spec["learning_rate"], beta=spec["beta"],
        loss_type=["sigmoid"], lr_scheduler_type="constant", gradient_checkpointing=False,
        train_sampling_strategy="sequential", seed=spec["seed"],
    )
    assert DPOConfig.per_device_train_batch_size == TRL_MICRO_BATCH and not args.padding_free
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    steps = harness.record_trl_steps(trainer, describe_micro_batch)
    trainer.train()
    (Path(spec["out"]) / "steps.json").write_text(json.dumps({"steps": [step_record(step) for step in steps]}))
    return 0


# ---------------------------------------------------------------- the parent: data, models, runs


def prepare(args, work: Path) -> dict:
    """Models, the pairs (openpack's file order, and TRL's copy in openpack's step order), the step plan."""
    pairs = args.pairs_per_step * args.steps
    lengths = harness.scaled_lengths(pairs, args.scale, args.seed)
    rows = harness.preference_rows(lengths, args.seed)
    row_cap = harness.ROW_CAP // args.scale
    model = ModelSpec(args.vocab, args.hidden, args.intermediate, args.layers, max_position_embeddings=2 * row_cap)
    policy, reference = harness.save_models(work, model, seeds=[0, 1])
    # openpack shuffles the pairs into steps with its seed; TRL reads them sequentially in that order
    steps = epoch_steps(pairs, args.pairs_per_step, args.seed, 0)
    order = [i for step in steps for i in step]
    return {
        "work": work, "policy": policy, "reference": reference, "model": model, "lengths": lengths,
        "row_cap": row_cap, "max_tokens": OPENPACK_DEFAULT_CAP // args.scale, "steps": steps,
        "openpack_data": harness.write_jsonl(work / "pairs.jsonl", rows),
        "trl_data": harness.write_jsonl(work / "pairs_in_step_order.jsonl", [rows[i] for i in order]),
    }


def openpack_command(args, setup: dict, save_path: Path) -> list[str]:
    return [
        "-m", "openpack.cli.main", "train_dpo", "--launcher", "local",
        "--pretrain", str(setup["policy"]), "--ref_pretrain", str(setup["reference"]),
        "--dataset", str(setup["openpack_data"]), "--packing_samples", "--use_dynamic_batch",
        "--max_tokens_per_gpu", str(setup["max_tokens"]), "--max_len", str(setup["row_cap"]),
        "--train_batch_size", str(args.pairs_per_step), "--max_steps", str(args.steps),
        "--learning_rate", str(args.learning_rate), "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
        "--adam_betas", "0.9", "0.999", "--max_norm", "1.0", "--beta", str(args.beta), "--loss_type", "sigmoid",
        "--seed", str(args.seed), "--save_path", str(save_path),
    ]


def run_openpack(args, setup: dict, run_dir: Path, env: dict, flags: tuple[str, ...] = ()) -> dict:
    """One openpack run: ``openpack_command`` plus ``flags`` (prefix_sharing.py adds --prefix_sharing and LoRA,
    fused_loss.py --fused_loss)."""
    measured = harness.run_measured([*openpack_command(args, setup, run_dir), *flags], run_dir.with_suffix(".log"),
                                    env)
    harness.check_run(measured, " ".join(["openpack train_dpo", *flags]))
    keep = ("loss", "grad_norm", "pairs", "tokens", "micro_batches", "packing_efficiency", "step_time_s")
    steps = [{k: s[k] for k in keep} for s in harness.read_jsonl(run_dir / "metrics.jsonl")]
    return {"steps": steps, "peak_rss_mb": measured.peak_rss_mb, "wall_s": measured.wall_s}


def run_trl(args, setup: dict, run_dir: Path, env: dict) -> dict:
    spec = {"policy": str(setup["policy"]), "reference": str(setup["reference"]), "dataset": str(setup["trl_data"]),
            "pairs_per_step": args.pairs_per_step, "steps": args.steps, "max_length": setup["row_cap"],
            "learning_rate": args.learning_rate, "beta": args.beta, "seed": args.seed}
    return harness.run_trl_worker(__file__, spec, run_dir, env, "TRL DPOTrainer worker")


def run_all(args, setup: dict, work: Path) -> list[dict]:
    env = harness.subprocess_env(args.threads)
    return harness.run_interleaved({
        "openpack": lambda repeat: run_openpack(args, setup, work / f"openpack_{repeat}", env),
        "TRL": lambda repeat: run_trl(args, setup, work / f"trl_{repeat}", env),
    }, args.repeats)


# ---------------------------------------------------------------- openpack's CPU attention, timed in-process


def first_row_segments(setup: dict) -> list[int]:
    """Segment lengths of the first packed row openpack trains on (step 1's first pack)."""
    lengths = setup["lengths"]
    rows = lengths.dpo_rows()
    step = setup["steps"][0]
    plan = plan_packs([rows[i].tolist() for i in step], setup["max_tokens"])
    return [int(n) for g in plan.packs[0] for n in rows[step[g]]]


def attention_timings(setup: dict, threads: int, repeats: int = 2) -> dict:
    """Forward and backward seconds of one layer's attention over the row, best of ``repeats`` after a warm-up.

    openpack: ``packed_attention`` with the sdpa backend (what ``--attn_backend
    auto`` picks on CPU). Reference: causal SDPA on each segment's slice of the
    row, outputs concatenated: the same result (checked) with no gathers.
    """
    import torch
    import torch.nn.functional as F

    from openpack.models.attention import packed_attention, set_attention_backend

    torch.set_num_threads(threads)
    set_attention_backend("sdpa")
    segments = first_row_segments(setup)
    cu_seqlens = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    heads, kv_heads = 4, 2  # as in ModelSpec: tiny_config's 4 query / 2 KV heads
    head_dim = setup["model"].hidden_size // heads
    generator = torch.Generator().manual_seed(0)
    tokens = sum(segments)
    q, k, v = (torch.randn(1, h, tokens, head_dim, generator=generator).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    layer = type("Layer", (), {"num_key_value_groups": heads // kv_heads})()

    def openpack_kernel():
        out, _ = packed_attention(layer, q, k, v, None, cu_seq_lens_q=cu_seqlens, max_length_q=max(segments))
        return out  # [1, T, H, D]

    def sliced():
        outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                               enable_gqa=True) for s, e in itertools.pairwise(cu_seqlens.tolist())]
        return torch.cat(outs, dim=2).transpose(1, 2)

    result = {"segments": len(segments), "distinct_lengths": len(set(segments)), "tokens": tokens}
    outputs = {}
    for name, attend in (("openpack", openpack_kernel), ("sliced", sliced)):
        forward, backward = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            out = attend()
            middle = time.perf_counter()
            out.sum().backward()
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
        outputs[name] = out.detach()
        result[name] = {"forward_s": min(forward[1:]), "backward_s": min(backward[1:])}
    result["max_abs_diff"] = (outputs["openpack"] - outputs["sliced"]).abs().max().item()
    return result


# ---------------------------------------------------------------- summary


def step_work(setup: dict, steps: list[int]) -> dict:
    """Real tokens and label tokens (the rows openpack's LM head projects) of these steps, from the lengths."""
    lengths = setup["lengths"]
    ids = [i for s in steps for i in setup["steps"][s]]
    real = sum(int(2 * lengths.prompt[i] + lengths.chosen[i] + lengths.rejected[i]) for i in ids)
    labels = sum(int(lengths.chosen[i] + lengths.rejected[i]) for i in ids)
    return {"real": real, "labels": labels}


def mean_over(run: dict, key: str, steps: list[int]) -> float:
    return sum(run["steps"][s][key] for s in steps) / len(steps)


def summarise(runs: list[dict], setup: dict, attention: dict) -> dict:
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
    layers = setup["model"].num_hidden_layers
    rows = mean_over(ours[0], "micro_batches", measured)
    summary.update(
        speedup=[o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, trl)],
        memory_ratio=[t["peak_rss_mb"] / o["peak_rss_mb"] for o, t in zip(ours, trl)],
        first_step_loss={"openpack": [r["steps"][0]["loss"] for r in ours],
                         "TRL": [r["steps"][0]["loss"] for r in trl]},
        first_step_loss_diff=[abs(o["steps"][0]["loss"] - t["steps"][0]["loss"]) for o, t in zip(ours, trl)],
        max_step_loss_diff=[max(abs(a["loss"] - b["loss"]) for a, b in zip(o["steps"], t["steps"]))
                            for o, t in zip(ours, trl)],
        trl_computed_per_real=sum(trl[0]["steps"][s]["slots"] for s in measured) / work["real"],
        openpack_head_rows_per_real=work["labels"] / work["real"],
        micro_batches={"openpack": rows, "TRL": mean_over(trl[0], "micro_batches", measured)},
        packing_efficiency=mean_over(ours[0], "packing_efficiency", measured),
        real_tokens_per_step=work["real"] / len(measured),
        attention=attention,
        # per step: every layer, every packed row, policy forward + backward and the reference's forward
        attention_s_per_step={name: layers * rows * (2 * attention[name]["forward_s"] + attention[name]["backward_s"])
                              for name in ("openpack", "sliced")},
    )
    return summary


def results_table(s: dict) -> str:
    lines = [
        "| framework | real tokens/s | pairs/s | s / optimizer step | micro-batches / step | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in ARMS:
        lines.append(
            f"| {arm} | {harness.fmt_spread(s['tokens_per_s'][arm])} "
            f"| {harness.fmt_spread(s['pairs_per_s'][arm], '{:.2f}')} "
            f"| {harness.fmt_spread(s['step_time_s'][arm], '{:.2f}')} | {s['micro_batches'][arm]:.1f} "
            f"| {harness.fmt_spread(s['peak_rss_mb'][arm])} |")
    speedup = harness.fmt_spread(s["speedup"], "{:.2f}x")
    lines.append(f"| **openpack / TRL** | **{speedup}** | {speedup} | {speedup} faster | "
                 f"| {harness.fmt_spread(s['memory_ratio'], '{:.2f}x')} less |")
    return "\n".join(lines)


def loss_check(s: dict) -> str:
    ours, trl = s["first_step_loss"]["openpack"], s["first_step_loss"]["TRL"]
    return (f"Step-1 loss (same weights, reference and first batch): openpack {ours[0]:.6f}, TRL {trl[0]:.6f}, "
            f"|difference| {max(s['first_step_loss_diff']):.1e} (largest over repeats); the largest per-step "
            f"difference over whole runs is {max(s['max_step_loss_diff']):.1e}")


def attention_line(s: dict) -> str:
    a = s["attention"]
    ours, sliced = a["openpack"], a["sliced"]
    return (f"One layer's attention over openpack's first packed row ({a['tokens']} tokens, "
            f"{a['segments']} segments, {a['distinct_lengths']} distinct lengths): openpack's CPU kernel "
            f"{1000 * ours['forward_s']:.0f} ms forward + {1000 * ours['backward_s']:.0f} ms backward; "
            f"SDPA on each segment's slice {1000 * sliced['forward_s']:.0f} + {1000 * sliced['backward_s']:.0f} ms "
            f"(same output, max difference {a['max_abs_diff']:.1e}). Estimated per step (layers x rows x "
            f"policy forward, backward and reference forward): {s['attention_s_per_step']['openpack']:.1f} s vs "
            f"{s['attention_s_per_step']['sliced']:.2f} s")


def setup_text(args, setup: dict, s: dict) -> str:
    return (
        f"Model: {setup['model'].describe()}; fp32. Data: {args.pairs_per_step * args.steps} pairs "
        f"({args.steps} steps of {args.pairs_per_step}), seed {args.seed}, "
        f"{harness.scaled_mix_description(args.scale)} (**scale factor {args.scale}**: rows <= "
        f"{setup['row_cap']} tokens; {s['real_tokens_per_step']:.0f} real tokens per measured step). Both: max "
        f"length {setup['row_cap']} per sequence (nothing truncated), {args.pairs_per_step} pairs per optimizer "
        f"step, sigmoid loss, beta {args.beta}, lr {args.learning_rate:g} constant, AdamW (0.9, 0.999), no weight "
        f"decay, clip 1.0, no gradient checkpointing, a reference of the same architecture (another seed), "
        f"{args.threads} thread{'s' if args.threads != 1 else ''}. openpack: `--max_tokens_per_gpu "
        f"{setup['max_tokens']}` (its default 16384 / {args.scale}), `--zero_stage 2` (its default; one CPU rank "
        "runs it as stage 0), attention per segment. "
        f"TRL: `DPOConfig(use_cpu=True, bf16=False, gradient_checkpointing=False, "
        f"gradient_accumulation_steps={args.pairs_per_step // TRL_MICRO_BATCH}, train_sampling_strategy="
        f"\"sequential\", ...)`, {TRL_MICRO_BATCH} pairs per padded micro-batch (its default), SDPA with a padding "
        f"mask (its default attention on CPU). Step 1 of every run is warm-up and not counted."
    )


def markdown_section(args, setup: dict, s: dict, chart: Path | None, doc: Path, wall_s: float) -> str:
    image = f"![DPO tokens/s and peak memory]({os.path.relpath(chart, doc.parent)})\n\n" if chart else ""
    cmd = harness.shell_command(openpack_command(args, setup, setup["work"] / "RUN_DIR"))
    cmd = cmd.replace(f"{setup['work']}/", "")  # paths relative to the work folder
    padding, head = s["trl_computed_per_real"], s["openpack_head_rows_per_real"]
    step_s = harness.spread(s["step_time_s"]["openpack"])[1]
    kernel_overhead = s["attention_s_per_step"]["openpack"] - s["attention_s_per_step"]["sliced"]
    return f"""## DPO: openpack vs TRL DPOTrainer (`benchmarks/dpo_vs_trl.py`)

```
python benchmarks/dpo_vs_trl.py
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s. The machine was shared with other
work, so single timings move by 10-50% between runs; each framework ran {args.repeats}x, interleaved, and
every cell is median (min-max) over repeats (ratios are taken per repeat pair).

{setup_text(args, setup, s)} The openpack command (paths relative to the work folder):

```
{cmd}
```

{results_table(s)}

{loss_check(s)}.

{image}{attention_line(s)}.

**Why openpack is faster on this CPU: {harness.spread(s['speedup'])[1]:.1f}x.** Two causes that multiply.
Padding: TRL pads the chosen and rejected rows of 8 pairs to the longest of the 16, so its model computes
{padding:.2f}x the real tokens of the measured steps (a small sample: over 20000 pairs of this mix, scaled
or not, it is 2.43x, as ANCHORS states); openpack computes each real token once, in
{s['micro_batches']['openpack']:.1f} packed rows per step ({100 * s['packing_efficiency']:.0f}% of the
{setup['max_tokens']}-token cap). The LM head: TRL 1.16's fused log-prob head scores only labelled positions
on CUDA/XPU (Triton), but on any other device it projects *every* position, padding and prompt included,
through the vocab ({padding:.2f}x the real tokens), while openpack projects only label tokens
({head:.2f}x the real tokens: the completions), {padding / head:.1f}x fewer rows, in the policy and again
in the reference. The head is most of this small model's work, so the second cause weighs most.

**Memory: {harness.spread(s['memory_ratio'])[1]:.1f}x less.** Both processes hold the same weights,
reference and AdamW state (~0.4 GiB) and several hundred MiB of Python and libraries. TRL's CPU head
allocates tiles of min(positions, 4096) x 32768 fp32 logits (512 MiB each, several alive in the backward),
and its activations are for 16 padded rows of the longest length; openpack's head works in 2^26-logit
chunks (256 MiB; one alive at a time, see the log-prob section) and its activations are for one row of
at most {setup['max_tokens']} tokens.

**The CPU attention kernel.** `openpack/models/attention.py` (`_sdpa_kernel`, what `--attn_backend auto`
picks on CPU) reorders the row once so that the segments of each length form one block, runs SDPA once per
distinct length and restores the order: every step is O(row length), forward and backward. On this
long-tailed mix almost every segment has its own length, so it is close to one SDPA call per segment; the
estimate above puts it at {kernel_overhead:+.1f} s per step against plain per-segment slices (openpack's step:
{step_s:.1f} s). An earlier version gathered and scattered each length group over the whole row, which
cost about 0.8 s per step here (issue 6 notes).

**What does not carry over to a GPU.** There TRL's head is compact, so the head gap closes and what remains
is padding: at most 2.43x in tokens on this mix, less in time since the optimizer step and fixed costs do
not shrink with padding. openpack does not compute the shared prompt once for chosen and rejected
(ANCHORS: a further 22.6% of the tokens), so the 3x target over TRL's padded DPO is out of reach on a GPU
until it does. The model here is tiny and its LM head is most of the work; for an 8B Llama the head is ~7%
of the work and padding is what remains.
"""


def charts(path: Path, s: dict) -> None:
    harness.speed_and_memory_charts(path, s, ARMS, "DPO", "DPO on CPU: openpack vs TRL 1.16 DPOTrainer")


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, trl_worker, "dpo_vs_trl_")


def benchmark(args, work: Path) -> int:
    """Run every arm in ``work``, print the tables, write results.json there and the docs section."""
    started = time.perf_counter()
    setup = prepare(args, work)
    print(f"model: {setup['model'].describe()}")
    print(f"data: {args.pairs_per_step * args.steps} pairs, scale factor {args.scale} (rows <= {setup['row_cap']} "
          f"tokens); work folder {work}")
    print("openpack:", harness.shell_command(openpack_command(args, setup, work / "openpack_<repeat>")))
    runs = run_all(args, setup, work)
    attention = attention_timings(setup, args.threads)
    summary = summarise(runs, setup, attention)
    wall_s = time.perf_counter() - started
    print(results_table(summary))
    print(loss_check(summary))
    print(attention_line(summary))
    print(f"TRL computes {summary['trl_computed_per_real']:.2f}x the real tokens; openpack's LM head projects "
          f"{summary['openpack_head_rows_per_real']:.2f}x; total wall time {wall_s:.0f} s")
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
