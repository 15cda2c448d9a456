"""Memory and time of per-token log-probs: openpack's chunked LM head vs full logits, on CPU.

    python benchmarks/logprob_memory.py [--vocabs 32000,128256,152064] [--tokens 8192] [--hidden 256]
    python benchmarks/logprob_memory.py --smoke --out /tmp/x     # seconds-long check of the harness (CI)

For one packed row of ``--tokens`` tokens, every one with a label, and an LM
head of ``vocab x hidden`` (fp32), each arm computes log p(label) for every
token, sums them and backpropagates into the hidden states and the head:

* chunked: ``openpack.core.logprobs.token_logprobs``: logits for
  ``2^26 / vocab`` tokens at a time, recomputed in the backward, so the
  ``tokens x vocab`` logits never exist at once;
* full: ``(hidden @ weight.T).log_softmax(-1).gather(...)``, what a plain
  model's forward and a log-softmax do: the whole logits tensor, its
  log-softmax and their gradients (``tokens x vocab x 4`` bytes each: 4.6 GiB
  at 8192 x 152064).

Each measurement runs in a fresh process, which reports its resident memory
just before the forward (torch, the inputs and the head: the baseline) and
its peak after the backward; "extra" is peak minus baseline. A full-logits
case whose predicted peak exceeds the memory available is skipped and
reported as such instead of being run into the OOM killer. Hidden size only
scales time (the logits do not depend on it); 256 keeps the run short.
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
from harness import Panel

ARMS = ("chunked", "full")
SECTION = "logprob_memory"
FULL_LOGIT_COPIES = 3.2  # logits, log-softmax and the gradient of each, at most ~3 alive at once (measured 3.0)
MARGIN_MB = 1024


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="32000,128256,152064", help="comma-separated vocab sizes")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the row (all labelled)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the LM head")
    parser.add_argument("--repeats", type=int, default=1, help="fresh-process runs of each case")
    harness.add_output_args(parser, SECTION, chart="memory and time")
    parser.add_argument("--smoke", action="store_true",
                        help="one small vocab, 512 tokens; docs only to a --markdown file")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.vocabs, args.tokens, args.hidden, args.repeats = "4096", 512, 64, 1
    args.markdown, args.chart = harness.docs_outputs(args.markdown, args.chart, SECTION, args.smoke)
    args.vocab_sizes = [int(v) for v in args.vocabs.split(",")]
    return args


# ---------------------------------------------------------------- one measurement, in its own process


def full_logprobs(hidden, weight, labels):
    """log p(label) through the whole [T, V] logits, as a plain model's forward and a log-softmax compute it."""
    return (hidden @ weight.T).log_softmax(-1).gather(1, labels[:, None])[:, 0]


def worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    import torch

    from openpack.core.logprobs import default_chunk_tokens, token_logprobs

    generator = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = spec["tokens"], spec["hidden"], spec["vocab"]
    hidden = torch.randn(tokens, hidden_size, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    compute = token_logprobs if spec["arm"] == "chunked" else full_logprobs
    baseline = harness.process_memory_mb()["VmRSS"]
    start = time.perf_counter()
    logprobs = compute(hidden, weight, labels)
    forward_s = time.perf_counter() - start
    logprobs.sum().backward()
    total_s = time.perf_counter() - start
    result = {"baseline_mb": baseline, "peak_mb": harness.process_memory_mb()["VmHWM"], "forward_s": forward_s,
              "backward_s": total_s - forward_s, "total_s": total_s, "logprob_sum": logprobs.sum().item(),
              "chunk_tokens": default_chunk_tokens(vocab) if spec["arm"] == "chunked" else tokens}
    result["extra_mb"] = result["peak_mb"] - baseline
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the parent


def logits_mb(args, vocab: int) -> float:
    return args.tokens * vocab * 4 / 2**20


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def measure(args, work: Path, arm: str, vocab: int, repeat: int, env: dict) -> dict:
    case = {"arm": arm, "vocab": vocab, "repeat": repeat}
    needed = FULL_LOGIT_COPIES * logits_mb(args, vocab) + MARGIN_MB if arm == "full" else 0.0
    if needed > available_mb():
        return {**case, "skipped": f"needs ~{needed / 1024:.1f} GiB, {available_mb() / 1024:.1f} GiB available"}
    name = f"{arm}_{vocab}_{repeat}"
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps({"arm": arm, "vocab": vocab, "tokens": args.tokens, "hidden": args.hidden,
                                     "out": str(work / f"{name}.result.json")}))
    measured = harness.run_measured([__file__, "--worker", str(spec_path)], work / f"{name}.log", env)
    if measured.returncode != 0:  # e.g. -9: the OOM killer, despite the check
        return {**case, "skipped": f"process exited with {measured.returncode} (see {measured.log})"}
    return {**case, **json.loads((work / f"{name}.result.json").read_text()), "wall_s": measured.wall_s}


def run_all(args, work: Path) -> list[dict]:
    env = harness.subprocess_env(args.threads)
    results = []
    for vocab in args.vocab_sizes:
        for repeat in range(args.repeats):
            for arm in ARMS:
                result = measure(args, work, arm, vocab, repeat, env)
                results.append(result)
                if "skipped" in result:
                    print(f"  vocab {vocab:6d} {arm:7s}: skipped, {result['skipped']}", flush=True)
                else:
                    print(f"  vocab {vocab:6d} {arm:7s}: extra {result['extra_mb']:.0f} MiB (peak "
                          f"{result['peak_mb']:.0f}), forward + backward {result['total_s']:.1f} s", flush=True)
    return results


def summarise(args, results: list[dict]) -> list[dict]:
    """One row per vocab: each arm's repeats, and the full / chunked ratios of extra memory and time."""
    rows = []
    for vocab in args.vocab_sizes:
        row = {"vocab": vocab, "logits_mb": logits_mb(args, vocab)}
        for arm in ARMS:
            done = [r for r in results if r["vocab"] == vocab and r["arm"] == arm and "skipped" not in r]
            skipped = [r["skipped"] for r in results if r["vocab"] == vocab and r["arm"] == arm and "skipped" in r]
            row[arm] = {key: [r[key] for r in done] for key in ("extra_mb", "peak_mb", "baseline_mb", "total_s")}
            row[arm]["skipped"] = skipped[0] if skipped and not done else None
        if row["full"]["extra_mb"] and row["chunked"]["extra_mb"]:
            row["memory_ratio"] = [f / c for f, c in zip(row["full"]["extra_mb"], row["chunked"]["extra_mb"])]
            row["time_ratio"] = [c / f for f, c in zip(row["full"]["total_s"], row["chunked"]["total_s"])]
        rows.append(row)
    return rows


def results_table(rows: list[dict]) -> str:
    lines = [
        ("| vocab | one logits copy (MiB) | chunked: extra / peak (MiB) | full: extra / peak (MiB) "
         "| full / chunked extra memory | chunked: fwd+bwd (s) | full: fwd+bwd (s) | chunked / full time |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = []
        for arm in ARMS:
            r = row[arm]
            cells.append(f"not run: {r['skipped']}" if r["skipped"] else
                         f"{harness.fmt_spread(r['extra_mb'])} / {harness.fmt_spread(r['peak_mb'])}")
        times = [harness.fmt_spread(row[arm]["total_s"], "{:.1f}") if row[arm]["total_s"] else "—" for arm in ARMS]
        memory = harness.fmt_spread(row["memory_ratio"], "{:.1f}x") if "memory_ratio" in row else "—"
        speed = harness.fmt_spread(row["time_ratio"], "{:.2f}x") if "time_ratio" in row else "—"
        lines.append(f"| {row['vocab']} | {row['logits_mb']:.0f} | {cells[0]} | {cells[1]} | {memory} | "
                     f"{times[0]} | {times[1]} | {speed} |")
    return "\n".join(lines)


def discussion(args, rows: list[dict]) -> str:
    """What the table shows, with its numbers; only for vocabs where both arms ran."""
    both = [r for r in rows if "memory_ratio" in r]
    if not both:
        return "Full logits did not fit in memory at any vocab measured; no ratio to report."
    mid = next((r for r in both if r["vocab"] >= 100_000), both[-1])
    memory, time_ratio = harness.spread(mid["memory_ratio"])[1], harness.spread(mid["time_ratio"])[1]
    full_copies = harness.spread(mid["full"]["extra_mb"])[1] / mid["logits_mb"]
    chunk_mb = 2**26 * 4 / 2**20
    chunked_extra = [harness.spread(r["chunked"]["extra_mb"])[1] for r in both]
    slowdowns = [harness.spread(r["time_ratio"])[1] for r in both]
    skipped = [r["vocab"] for r in rows if r["full"]["skipped"]]
    not_run = (f" Full logits were not run at vocab {', '.join(map(str, skipped))}: their predicted peak did not "
               "fit in the memory available." if skipped else "")
    return f"""**Memory.** At vocab {mid['vocab']} the chunked head needs {memory:.1f}x less extra memory than full
logits (target: at least 2x). Full logits hold about {full_copies:.1f} copies of the {args.tokens} x vocab fp32
logits at their peak (the logits, their log-softmax, and the gradient flowing back), so they grow with the row
and the vocab: {harness.spread(both[-1]['full']['extra_mb'])[1] / 1024:.1f} GiB at vocab {both[-1]['vocab']},
before any model weights or activations. The chunked head's extra stays between
{min(chunked_extra):.0f} and {max(chunked_extra):.0f} MiB whatever the vocab: the head's gradient (vocab x
{args.hidden} x 4 bytes) and chunk-sized buffers (the default chunk is 2^26 logits, {chunk_mb:.0f} MiB). Only one
chunk of logits is alive at a time (logsumexp and softmax work in its own buffer, and the head's gradient is
accumulated with `addmm_`), but the process's resident memory also keeps buffers the allocator has freed and
not returned, so measured as RSS it is {min(chunked_extra) / chunk_mb:.1f}-{max(chunked_extra) / chunk_mb:.1f}
chunks' worth. By construction it does not grow with the row beyond the hidden states' gradient.{not_run}

**Time.** The memory is paid for in time: the chunked head is {min(slowdowns):.2f}-{max(slowdowns):.2f}x slower
here ({time_ratio:.2f}x at vocab {mid['vocab']}), because its backward recomputes each chunk's logits (four
vocab-sized matmuls instead of three) and makes one more pass of exp over them. Liger-Kernel's fused
losses and TRL's 4096 x 32768 tiles make the same trade; on a GPU the full-logit gigabytes would come out of
device memory, for every packed row of a micro-batch.
"""


def markdown_section(args, rows: list[dict], chart: Path | None, doc: Path, wall_s: float) -> str:
    image = f"![log-prob memory and time]({os.path.relpath(chart, doc.parent)})\n\n" if chart else ""
    runs = "1 run each" if args.repeats == 1 else f"{args.repeats} runs each, cells median (min-max)"
    return f"""## Log-prob memory: chunked LM head vs full logits (`benchmarks/logprob_memory.py`)

```
python benchmarks/logprob_memory.py
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s. One row of {args.tokens} tokens, all
labelled, hidden size {args.hidden} (it scales time, not the logits' memory), fp32; forward, then backward into
the hidden states and the head; each case in a fresh process ({runs}). "Extra" is the process's peak RSS minus
its RSS just before the forward (torch, the inputs and the head's weights); the head's gradient is part of
both arms' extra.

{results_table(rows)}

{image}{discussion(args, rows)}"""


def charts(path: Path, rows: list[dict], tokens: int) -> None:
    groups = [f"vocab {row['vocab'] // 1000}k" for row in rows]
    names = {"chunked": "openpack chunked", "full": "full logits"}
    harness.save_bar_charts(path, [
        Panel("extra peak memory (lower is better)", "GiB", groups,
              {names[arm]: [[v / 1024 for v in row[arm]["extra_mb"]] for row in rows] for arm in ARMS}, "%.1f"),
        Panel("forward + backward time (lower is better)", "seconds", groups,
              {names[arm]: [row[arm]["total_s"] for row in rows] for arm in ARMS}, "%.1f"),
    ], f"Per-token log-probs of a {tokens}-token row on CPU: openpack's chunked head vs full logits")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    return harness.run_in_work_folder(args, benchmark, None, "logprob_memory_")


def benchmark(args, work: Path) -> int:
    """Run every arm in ``work``, print the tables, write results.json there and the docs section."""
    started = time.perf_counter()
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocabs {args.vocab_sizes}; work folder {work}")
    results = run_all(args, work)
    rows = summarise(args, results)
    wall_s = time.perf_counter() - started
    print(results_table(rows))
    print(f"total wall time {wall_s:.0f} s")
    (work / "results.json").write_text(json.dumps({"settings": {k: str(v) if isinstance(v, Path) else v
                                                                for k, v in vars(args).items()},
                                                   "results": results, "rows": rows, "wall_s": wall_s}, indent=1))
    if args.markdown is not None:
        charts(args.chart, rows, args.tokens)
        harness.write_section(args.markdown, SECTION, markdown_section(args, rows, args.chart, args.markdown, wall_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
