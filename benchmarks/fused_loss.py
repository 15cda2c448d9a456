"""--fused_loss vs the chunked log-probs on CPU: the LM head alone, then whole DPO steps.

    python benchmarks/fused_loss.py [--repeats 3] [--steps 4] [--scale 4] [--vocab 32000] [--markdown PATH]
    python benchmarks/fused_loss.py --smoke --out /tmp/x     # seconds-long check of the script (CI)
    python benchmarks/fused_loss.py --head_only --device cuda --dtype bfloat16 --head_tokens 8192   # a GPU

Part 1, the head (run last, in this process): for a row of ``--head_tokens`` labelled tokens at width ``--head_hidden`` (Qwen2.5-0.5B's 896)
and each of ``--head_vocabs``, the time of forward + backward through the LM head and a loss on per-pair sums,
chunked (``core/logprobs.py``: logits in the forward, again in the backward) vs fused (``core/fused_loss.py``:
once), interleaved in one process, best of ``--repeats``. The head's gradients must agree.

Part 2, whole steps: ``openpack train_dpo --packing_samples --use_dynamic_batch`` (``dpo_vs_trl.py``'s command)
with and without ``--fused_loss`` on the same saved model, reference and pairs (``dpo_vs_trl.py``'s: the ANCHORS
length mix divided by ``--scale``; by default the TRL comparisons' model, whose vocab-32000 head is most of its
work), in fresh interleaved processes: seconds per optimizer step after the first (warm-up) and peak RSS,
median (min-max) over repeats. The two arms compute the same numbers, so the script checks their losses agree.
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

SECTION = "fused_loss"
ARM_FLAGS = {"chunked": (), "fused": ("--fused_loss",)}  # each arm's flags on top of dpo_vs_trl.openpack_command
ARMS = tuple(ARM_FLAGS)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs_per_step", type=int, default=16, help="pairs per optimizer step")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (sigmoid loss)")
    parser.add_argument("--head_tokens", type=int, default=2048, help="part 1: labelled tokens in the row")
    parser.add_argument("--head_hidden", type=int, default=896, help="part 1: width of the LM head")
    parser.add_argument("--head_vocabs", default="32000,151936", help="part 1: comma-separated vocab sizes")
    parser.add_argument("--head_only", action="store_true", help="part 1 only: print its table, write no docs")
    parser.add_argument("--device", default="cpu", help="part 1: device of the head (e.g. cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="part 1: dtype of the head")
    harness.add_run_args(parser, SECTION, learning_rate=5e-6)
    parser.set_defaults(steps=4, repeats=3)
    args = parser.parse_args(argv)
    args.given = harness.given_flags(argv)
    if args.smoke:
        args.pairs_per_step, args.head_tokens, args.head_hidden, args.head_vocabs = 8, 64, 32, "512"
        harness.apply_smoke(args)
    args.markdown, _ = harness.docs_outputs(args.markdown, None, SECTION, args.smoke)
    args.vocab_sizes = [int(v) for v in args.head_vocabs.split(",")]
    return args


# ---------------------------------------------------------------- part 1: the head alone


def head_times(args) -> list[dict]:
    """Per vocab: seconds of forward + backward, chunked and fused (each repeat), and their gradients' difference."""
    import torch

    from openpack.core.fused_loss import FusedLoss, fused_segment_loss
    from openpack.core.logprobs import token_logprobs

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for vocab in args.vocab_sizes:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(args.head_tokens, args.head_hidden, generator=gen).to(device, dtype)
        weight = (torch.randn(vocab, args.head_hidden, generator=gen) * 0.02).to(device, dtype)
        labels = torch.randint(0, vocab, (args.head_tokens,), generator=gen)
        segments = torch.arange(args.head_tokens) * 10 // args.head_tokens  # 5 pairs of equal length
        num_segments = 10
        fused_loss = FusedLoss(None, labels, segments // 2)  # host-side labels and pairs, as the trainer passes
        labels, segments = labels.to(device), segments.to(device)

        def loss_of(sums):  # a DPO-like loss of each pair's two sums
            return -torch.nn.functional.logsigmoid(0.1 * (sums[0::2] - sums[1::2])).sum()

        fused_loss.loss_of_sums = loss_of

        def chunked(h, w):
            per_token = token_logprobs(h, w, labels)
            loss_of(torch.zeros(num_segments, device=device).index_add(0, segments, per_token)).backward()

        def fused(h, w):
            loss, _ = fused_segment_loss(h, w, segments, labels, num_segments, fused_loss)
            loss.backward()

        times, grads = {arm: [] for arm in ARMS}, {}
        for _ in range(args.repeats + (device.type == "cuda")):  # on a GPU, one more: the first is warm-up
            for arm, run in (("chunked", chunked), ("fused", fused)):
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                sync()
                start = time.perf_counter()
                run(h, w)
                sync()
                times[arm].append(time.perf_counter() - start)
                grads[arm] = (h.grad, w.grad)
        if device.type == "cuda":
            times = {arm: t[1:] for arm, t in times.items()}
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["chunked"], grads["fused"]))
        rows.append({"vocab": vocab, "times": times, "grad_diff": diff, "threads": torch.get_num_threads(),
                     "ratio": min(times["fused"]) / min(times["chunked"])})
        print(f"  head, vocab {vocab}: chunked {min(times['chunked']):.2f} s, fused {min(times['fused']):.2f} s, "
              f"ratio {rows[-1]['ratio']:.3f}, gradient difference {diff:.1e}", flush=True)
    return rows


# ---------------------------------------------------------------- part 2: whole DPO steps


def summarise(runs: list[dict], head: list[dict], load: list[float]) -> dict:
    per_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    loss_diff = max(abs(a["loss"] - b["loss"]) for c, f in zip(per_arm["chunked"], per_arm["fused"])
                    for a, b in zip(c["steps"], f["steps"]))
    return {
        "head": head,
        "step_time_s": harness.by_arm(runs, "step_time_s"),
        "peak_rss_mb": harness.by_arm(runs, "peak_rss_mb"),
        "time_ratio": [f["step_time_s"] / c["step_time_s"] for c, f in zip(per_arm["chunked"], per_arm["fused"])],
        "max_loss_diff": loss_diff,
        "max_grad_diff": max(row["grad_diff"] for row in head),
        "load": load,
        "head_threads": head[0]["threads"],
    }


def head_table(s: dict) -> str:
    lines = ["| vocab | chunked: fwd+bwd (s) | fused: fwd+bwd (s) | fused / chunked time |", "|---:|---:|---:|---:|"]
    for row in s["head"]:
        lines.append(f"| {row['vocab']} | {harness.fmt_spread(row['times']['chunked'], '{:.2f}')} "
                     f"| {harness.fmt_spread(row['times']['fused'], '{:.2f}')} | **{row['ratio']:.2f}** |")
    return "\n".join(lines)


def step_table(s: dict) -> str:
    lines = ["| arm | s / optimizer step | peak RSS (MiB) |", "|---|---:|---:|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {harness.fmt_spread(s['step_time_s'][arm], '{:.2f}')} "
                     f"| {harness.fmt_spread(s['peak_rss_mb'][arm])} |")
    lines.append(f"| **fused / chunked, per repeat pair** | **{harness.fmt_spread(s['time_ratio'], '{:.2f}')}** | |")
    return "\n".join(lines)


def markdown_section(args, setup: dict, s: dict, wall_s: float) -> str:
    cmd = harness.shell_command([*dpo_vs_trl.openpack_command(args, setup, setup["work"] / "RUN_DIR"),
                                 *ARM_FLAGS["fused"]])
    cmd = cmd.replace(f"{setup['work']}/", "")  # paths relative to the work folder
    head_ratios = [row["ratio"] for row in s["head"]]
    step = harness.spread(s["time_ratio"])[1]
    rss = {arm: harness.spread(values)[1] for arm, values in s["peak_rss_mb"].items()}
    rss_change = rss["fused"] / rss["chunked"] - 1
    head_mb = setup["model"].vocab_size * setup["model"].hidden_size * 4 / 2**20
    verdict = (f"the fused path is faster at every vocab measured ({min(head_ratios):.2f}-{max(head_ratios):.2f}x "
               "the chunked head's time)" if max(head_ratios) < 1 else
               f"the fused path is not faster at every vocab ({min(head_ratios):.2f}-{max(head_ratios):.2f}x the "
               "chunked head's time)")
    return f"""## Fused LM head + loss: `--fused_loss` vs chunked log-probs (`benchmarks/fused_loss.py`)

```
python benchmarks/fused_loss.py {args.given}
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s; {args.threads} thread(s) in each DPO run
(`--threads`), torch's default of {s['head_threads']} in the head part, which runs in the script's own process; load
average (1 min) {s['load'][0]:.1f} at the start and {s['load'][1]:.1f} at the end.

**The head alone**: one row of {args.head_tokens} labelled tokens, width {args.head_hidden}, fp32, 5 pairs of
equal length, forward + backward of a DPO-like loss of each pair's two sums into the hidden states and the head;
the arms interleaved in one process, {args.repeats} repeats, median (min-max), the ratio of the best times. The
gradients agree to {s['max_grad_diff']:.1e}.

{head_table(s)}

**Whole DPO steps**: {setup['model'].describe()}; fp32; a reference of the same shape (another seed).
{args.pairs_per_step * args.steps} pairs ({args.steps} steps of {args.pairs_per_step}, the first not counted),
{harness.scaled_mix_description(args.scale)}; `--max_tokens_per_gpu {setup['max_tokens']}`, sigmoid loss; each arm
{args.repeats}x in fresh processes, interleaved. The fused arm's command (the other drops `--fused_loss`):

```
{cmd}
```

{step_table(s)}

The two arms give the same run: the largest per-step loss difference is {s['max_loss_diff']:.1e}.
On this machine {verdict}: the chunked head computes each chunk's logits twice (four vocabulary-sized
matmuls per token), the fused one once (three), and makes one pass of exp fewer. A whole step gains
less ({step:.2f}x the chunked step's time, the median over repeat pairs), since the layers, the reference's forward and the optimizer
do not change. Peak RSS: {rss['fused']:.0f} MiB fused vs {rss['chunked']:.0f} chunked (medians, {rss_change:+.1%}):
both hold one chunk of logits at a time, but the fused head makes its fp32 gradient
({head_mb:.0f} MiB here) during the forward instead of the backward. The fused chunk holds whole pairs, so a pair longer than
the chunk budget (2^26 logits, 441 tokens at vocab 152k) makes a larger chunk. It is not the default: it covers
SFT and the DPO family (a loss of per-segment sums), not reward models (no LM head) or online RL.
"""


def benchmark(args, work: Path) -> int:
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    if args.head_only:
        head = head_times(args)
        print(f"{args.head_tokens} tokens, width {args.head_hidden}, {args.dtype} on {args.device}")
        print(head_table({"head": head}))
        (work / "results.json").write_text(json.dumps({"head": head}, indent=1))
        return 0
    setup = dpo_vs_trl.prepare(args, work)
    print(f"model: {setup['model'].describe()}")
    env = harness.subprocess_env(args.threads)
    runs = harness.run_interleaved({
        arm: (lambda repeat, arm=arm: dpo_vs_trl.run_openpack(args, setup, work / f"{arm}_{repeat}", env,
                                                              ARM_FLAGS[arm]))
        for arm in ARMS
    }, args.repeats)
    # The head part after the runs: a child started by vfork + exec inherits this process's peak RSS as its own
    # ru_maxrss, so gigabytes of head tensors here would show up as every run's peak.
    head = head_times(args)
    wall_s = time.perf_counter() - started
    summary = summarise(runs, head, load + [os.getloadavg()[0]])
    print(head_table(summary))
    print(step_table(summary))
    print(f"largest per-step loss difference {summary['max_loss_diff']:.1e}; wall time {wall_s:.0f} s")
    (work / "results.json").write_text(json.dumps({"runs": runs, "summary": summary, "wall_s": wall_s}, indent=1))
    if args.markdown is not None:
        harness.write_section(args.markdown, SECTION, markdown_section(args, setup, summary, wall_s))
    return 0 if summary["max_loss_diff"] < 1e-4 and summary["max_grad_diff"] < 1e-4 else 1


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, None, "fused_loss_")


if __name__ == "__main__":
    sys.exit(main())
