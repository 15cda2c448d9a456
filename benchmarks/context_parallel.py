"""Context parallelism on CPU: a long SFT row on 1 rank against the same row split over 2 (``--ring_attn_size 2``).

    python benchmarks/context_parallel.py [--lengths 4096,8192,16384] [--cap_mb 2000]
    python benchmarks/context_parallel.py --smoke --out /tmp/x     # seconds-long check of the harness (CI)

Four measurements, each rank in a fresh process:

* **balance** (no model): the causal attention work (query-key pairs, ``core.context_parallel.attention_work``)
  of the largest rank over the mean of its context group, per row, for the per-document zigzag split; on the
  ANCHORS length mix packed into rows of N x 4096 tokens and on rows of 1 to 4 long documents, N = 2, 4, 8, with
  and without a 512-token window; beside it, cutting the row itself into 2N chunks (a ring that ignores documents).
* **sweep**: one training step on a row of one document of L tokens (every token after the first a label): the
  packed forward (``PackedCausalLM``), the token-mean NLL, backward, the gradient summed over the context group
  (what DeepSpeed does over a group's ranks), AdamW. Arms at the same total cores: 1 rank with ``--threads``
  threads, and 2 ranks (zigzag split, K/V all-gathered over gloo) with half as many each. Per rank: its resident
  memory just before the step (model, gradients, AdamW state: the baseline, after a warm-up step on 256 tokens)
  and its peak during the step (``VmHWM``, reset by ``/proc/self/clear_refs`` after the warm-up); "step memory"
  is peak minus baseline: activations, the LM head's logit chunks, the gathered K/V, temporaries. Both arms'
  step-1 loss and grad norm must agree (the split is exact).
* **longest sample under a cap**: bisection over lengths (multiples of ``--resolution``) for the longest
  document whose step keeps every rank's whole-process peak resident memory (``VmHWM``, start-up included) under
  ``--cap_mb``; a watchdog thread ends a rank as soon as its ``VmRSS`` passes the cap (as an OOM would), and the
  final ``VmHWM`` decides. The sweep's lengths seed the brackets.
* **check** (``examples/gpu_runbook.py``'s section, ``--check``): on a row whose documents straddle the split,
  one longer than a rank's share and one starting on rank 1, each rank's log-probs and the summed gradients of
  its part against the whole row in the same process: N = 1 through the split code path (a single-rank group:
  NCCL on a GPU) and N = 2 (two processes on the same device; gloo, which takes CUDA tensors, since NCCL refuses
  two ranks on one GPU).

Model: a Llama from a config (random init), 4 layers, width 256, 4 query heads of 64 over 2 KV heads, MLP 768,
vocab 32000, fp32 on CPU: ``harness.ModelSpec``, the model of the openpack-vs-TRL benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import ModelSpec, Panel

SECTION = "context_parallel"
ARMS = {"1 rank": 1, "ring 2": 2}  # name -> ranks; threads per rank: --threads / ranks
WARMUP_TOKENS = 256
CHECK_LENGTHS = [9, 40, 3, 1, 11]  # tests/integration/context_parallel_script.py's row, times --check_scale
OUT_OF_MEMORY = 3  # a rank's exit code when its watchdog saw it pass the cap
MMAP_THRESHOLD = 65536  # a memory run's MALLOC_MMAP_THRESHOLD_: resident memory follows the live tensors


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384", help="comma-separated row lengths (tokens)")
    parser.add_argument("--cap_mb", type=float, default=2000.0,
                        help="per-rank cap on peak resident memory (MiB) for the longest sample; 0: skip the search")
    parser.add_argument("--resolution", type=int, default=256, help="the longest sample's search step (tokens)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each sweep arm, interleaved")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256, help="width (4 query heads of width / 4, 2 KV heads)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no_balance", action="store_true", help="skip the balance tables (about 10 s of CPU)")
    parser.add_argument("--check", action="store_true",
                        help="only the equality check of the split code path (examples/gpu_runbook.py)")
    parser.add_argument("--check_scale", type=int, default=64, help="--check's row: CHECK_LENGTHS x this")
    harness.add_output_args(parser, SECTION, chart="step memory and tokens/s")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, a row of 256 tokens, no cap (unless --cap_mb); docs only to a --markdown "
                             "file")
    parser.add_argument("--render", type=Path, default=None,
                        help="write the docs section and chart again from this results.json of an earlier run")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths, args.resolution, args.vocab, args.hidden, args.layers, args.intermediate = (
            "256", 128, 512, 128, 2, 256)
        args.cap_mb, args.check_scale = args.cap_mb if "--cap_mb" in (argv or sys.argv) else 0.0, 4
    docs = not args.check and args.device == "cpu"  # the GPU check reports in the runbook's block, not here
    args.markdown, args.chart = harness.docs_outputs(args.markdown if docs else "none", args.chart, SECTION,
                                                     args.smoke)
    args.length_list = [int(n) for n in args.lengths.split(",")]
    args.spec = ModelSpec(args.vocab, args.hidden, args.intermediate, args.layers, max(args.length_list) * 4)
    return args


# ---------------------------------------------------------------- one rank, in its own process


def worker(spec_path: Path, rank: int) -> int:
    spec = json.loads(spec_path.read_text())
    import torch
    import torch.distributed as dist

    from openpack.models.context_parallel import set_context_group

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    ranks = spec["ranks"]
    if spec["split"]:  # NCCL for a single-rank group on a GPU; two ranks on one GPU only through gloo
        backend = "nccl" if device.type == "cuda" and ranks == 1 else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=ranks)
        set_context_group(dist.group.WORLD)
    if spec.get("cap_mb"):
        threading.Thread(target=_watchdog, args=(spec["cap_mb"],), daemon=True).start()
    model = build_model(spec, device)
    if spec["mode"] == "check":
        result = check_split(model, spec, rank, device)
    else:
        result = measured_step(model, spec, rank, device)
    Path(f"{spec['out']}.rank{rank}.json").write_text(json.dumps(result))
    if spec["split"]:
        from openpack.distributed.process import exit_now

        dist.destroy_process_group()
        exit_now(0)  # not through finalisation: a gloo worker may still be releasing the last collective's tensors
    return 0


def build_model(spec: dict, device):
    import torch

    from openpack.models.tiny import tiny_causal_lm

    dtype = getattr(torch, spec["dtype"])
    overrides = ModelSpec(**spec["model"]).overrides()
    return tiny_causal_lm("llama", seed=0, vocab_size=spec["model"]["vocab_size"], **overrides).to(device, dtype)


def _watchdog(cap_mb: float) -> None:
    """End this rank the moment its resident memory passes the cap, as the OOM killer would a device's."""
    while True:
        memory = harness.process_memory_mb()
        if memory and memory["VmRSS"] > cap_mb:
            os._exit(OUT_OF_MEMORY)
        time.sleep(0.01)


def measured_step(model, spec: dict, rank: int, device) -> dict:
    """A warm-up step on WARMUP_TOKENS, then the measured step on one document of spec["length"] tokens."""
    import torch

    from openpack.core.batch import Segment
    from openpack.models.packed import PackedCausalLM

    packed = PackedCausalLM(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(spec["length"])

    def document(length):
        tokens = torch.randint(3, spec["model"]["vocab_size"], (length,), generator=generator).tolist()
        return [Segment(tokens, [False] + [True] * (length - 1), 0)]

    train_step(packed, optimizer, document(WARMUP_TOKENS), spec, rank, device)  # gradients, AdamW state, pools
    startup_peak = _memory(device)["peak_mb"]
    _reset_peak(device)
    baseline = _memory(device)["now_mb"]
    start = time.perf_counter()
    loss, grad_norm = train_step(packed, optimizer, document(spec["length"]), spec, rank, device)
    seconds = time.perf_counter() - start
    peak = _memory(device)["peak_mb"]
    return {"rank": rank, "loss": loss, "grad_norm": grad_norm, "step_s": seconds, "baseline_mb": baseline,
            "peak_mb": peak, "step_mb": peak - baseline, "process_peak_mb": max(peak, startup_peak)}


def train_step(packed, optimizer, segments, spec: dict, rank: int, device) -> tuple[float, float]:
    """One SFT step over one packed row; with spec["split"], this rank's part of it (the trainer's loss: the
    row's token-mean NLL, each rank's gradient summed over the group). The step's loss and grad norm."""
    import torch
    import torch.distributed as dist

    from openpack.core.batch import collate_packed
    from openpack.core.context_parallel import shard_batch, split_row

    batch = collate_packed(segments)
    labels = int(batch.loss_mask.sum())
    if spec["split"]:
        batch = shard_batch(batch, split_row(batch.cu_seqlens, spec["ranks"])[rank])
    batch = batch.to(device)
    nll = -(packed(batch) * batch.loss_mask.reshape(-1)).sum()
    (nll / labels).backward()
    grads = [p.grad for p in packed.parameters()]
    if spec["split"]:
        for grad in grads:
            dist.all_reduce(grad)
        dist.all_reduce(nll)
    grad_norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # kept, as DeepSpeed keeps its gradient buffers
    if device.type == "cuda":
        torch.cuda.synchronize()
    return nll.item() / labels, grad_norm


def _memory(device) -> dict:
    """This process's memory now and at its peak, MiB: resident on CPU, allocated by torch on a GPU."""
    import torch

    if device.type == "cuda":
        return {"now_mb": torch.cuda.memory_allocated() / 2**20, "peak_mb": torch.cuda.max_memory_allocated() / 2**20}
    memory = harness.process_memory_mb()
    return {"now_mb": memory["VmRSS"], "peak_mb": memory["VmHWM"]}


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:  # 5: reset the peak resident set size to the current (proc(5))
        Path("/proc/self/clear_refs").write_text("5")


def check_split(model, spec: dict, rank: int, device) -> dict:
    """This rank's part of the check row against the whole row, in this process: log-prob and summed-gradient
    errors; and, as the scale of the dtype's rounding, the whole row in this dtype against fp32 on SDPA."""
    import torch
    import torch.distributed as dist

    from openpack.core.batch import collate_packed
    from openpack.core.context_parallel import shard_batch, split_row
    from openpack.models.attention import set_attention_backend
    from openpack.models.packed import PackedCausalLM
    from openpack.models.verify import random_segments

    packed = PackedCausalLM(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = collate_packed(random_segments([n * spec["check_scale"] for n in CHECK_LENGTHS],
                                           spec["model"]["vocab_size"], seed=7))
    weights = torch.linspace(0.5, 1.5, batch.num_tokens, device=device)  # every position counts

    def logprobs_and_grads(row, index=None):
        logprobs = packed(row.to(device))
        weighted = weights if index is None else weights[index.to(device)]
        return logprobs.detach().float(), torch.autograd.grad((logprobs * weighted).sum(), params)

    whole, whole_grads = logprobs_and_grads(batch)
    shard = split_row(batch.cu_seqlens, spec["ranks"])[rank]
    local, grads = logprobs_and_grads(shard_batch(batch, shard), shard.token_index)
    split = torch.zeros_like(whole).index_put_((shard.token_index.to(device),), local)
    dist.all_reduce(split)
    for grad in grads:
        dist.all_reduce(grad)
    result = {"rank": rank, "tokens": batch.num_tokens, "held": shard.num_tokens,
              "logprob_error": (split - whole).abs().max().item(),
              "grad_error": max((a - b).abs().max().item() for a, b in zip(grads, whole_grads)),
              "grad_scale": max(b.abs().max().item() for b in whole_grads)}
    if spec["dtype"] != "float32":
        set_attention_backend("sdpa")
        model.float()
        reference, _ = logprobs_and_grads(batch)
        result["rounding_logprob_error"] = (whole - reference).abs().max().item()
    return result


# ---------------------------------------------------------------- the parent


def launch(args, work: Path, name: str, ranks: int, mode: str, malloc: str = "mmap", **fields) -> dict:
    """Run ``ranks`` worker processes on one spec; their reports, or the exit codes of a run that did not finish
    (a rank its watchdog ended: the others would wait on a collective for ever, so they are ended too).

    ``malloc`` "mmap": glibc maps every allocation of MMAP_THRESHOLD bytes or more on its own and unmaps it when
    freed, so resident memory is the tensors alive (slower: a page fault per new page); "default": glibc's heap,
    which keeps freed blocks resident, and more of them the more mid-sized temporaries a step makes."""
    from openpack.distributed.process import free_port

    split = fields.pop("split", False) or ranks > 1
    spec = {"ranks": ranks, "split": split, "mode": mode, "threads": max(1, args.threads // ranks),
            "device": args.device, "dtype": args.dtype, "model": vars(args.spec), "port": free_port(),
            "check_scale": args.check_scale, "out": str(work / name), **fields}
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = harness.subprocess_env(spec["threads"])
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    if args.device == "cuda":
        env.pop("CUDA_VISIBLE_DEVICES")
    with open(work / f"{name}.log", "w") as log:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(spec_path), "--rank", str(rank)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT) for rank in range(ranks)]
        codes = _wait_all(procs)
    if any(codes):
        return {"name": name, "exit": codes}
    return {"name": name, "exit": codes, "ranks": [json.loads(Path(f"{spec['out']}.rank{r}.json").read_text())
                                                   for r in range(ranks)]}


def _wait_all(procs: list[subprocess.Popen]) -> list[int]:
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return [p.returncode for p in procs]


def sweep(args, work: Path) -> list[dict]:
    """Every length, every arm (interleaved, ``--repeats`` times), each twice in fresh processes: a timed run on
    glibc's default heap, and a memory run (``launch``'s "mmap"); on a GPU one run serves both."""
    runs = []
    for length in args.length_list:
        for repeat in range(args.repeats):
            for arm, ranks in ARMS.items():
                name = f"sweep_{length}_{ranks}_{repeat}"
                timed = _finished(launch(args, work, f"{name}_timed", ranks, "step", "default", length=length), work)
                memory = timed if args.device == "cuda" else _finished(
                    launch(args, work, f"{name}_memory", ranks, "step", "mmap", length=length), work)
                run = {"arm": arm, "length": length, "repeat": repeat, "timed": timed, "memory": memory,
                       **_summary(timed, memory, length)}
                runs.append(run)
                print(f"  {length:6d} tokens {arm:7s}: step memory {run['step_mb']:.0f} MiB per rank (peak "
                      f"{run['peak_mb']:.0f}; on glibc's heap {run['heap_step_mb']:.0f}), "
                      f"{run['tokens_per_s']:.0f} tokens/s, loss {run['loss']:.6f}, grad norm {run['grad_norm']:.6f}",
                      flush=True)
    return runs


def _finished(run: dict, work: Path) -> list[dict]:
    if "ranks" not in run:
        raise RuntimeError(f"{run['name']} exited {run['exit']} (see {work / run['name']}.log)")
    return run["ranks"]


def _summary(timed: list[dict], memory: list[dict], length: int) -> dict:
    """An arm's numbers: the largest rank's memory, the slowest rank's time."""
    step_s = max(r["step_s"] for r in timed)
    return {"step_mb": max(r["step_mb"] for r in memory), "peak_mb": max(r["peak_mb"] for r in memory),
            "baseline_mb": max(r["baseline_mb"] for r in memory),
            "process_peak_mb": max(r["process_peak_mb"] for r in memory),
            "heap_step_mb": max(r["step_mb"] for r in timed), "step_s": step_s, "tokens_per_s": length / step_s,
            "loss": timed[0]["loss"], "grad_norm": timed[0]["grad_norm"]}


def longest_under_cap(args, work: Path, runs: list[dict]) -> dict:
    """Per arm, the longest document that trains under --cap_mb per rank (``bisect_longest``; the sweep's lengths
    are known points, a probe is a run with the watchdog on)."""
    found = {}
    for arm, ranks in ARMS.items():
        known = {r["length"]: r["process_peak_mb"] <= args.cap_mb for r in runs if r["arm"] == arm}
        probes = []

        def probe(length, arm=arm, ranks=ranks, probes=probes):
            run = launch(args, work, f"cap_{length}_{ranks}", ranks, "step", "mmap", length=length,
                         cap_mb=args.cap_mb)
            if "ranks" not in run and OUT_OF_MEMORY not in run["exit"]:
                raise RuntimeError(f"{arm} at {length} tokens exited {run['exit']}, not for the cap "
                                   f"(see {work / run['name']}.log)")
            peak = max(x["process_peak_mb"] for x in run["ranks"]) if "ranks" in run else None
            fits = peak is not None and peak <= args.cap_mb
            probes.append({"length": length, "fits": fits, "peak_mb": peak})
            print(f"  cap {args.cap_mb:.0f} MiB, {arm:7s}, {length:6d} tokens: {'fits' if fits else 'over'}"
                  + (f" (peak {peak:.0f} MiB)" if peak else " (stopped by its watchdog)"), flush=True)
            return fits

        longest, first_over = bisect_longest(probe, known, args.resolution)
        found[arm] = {"longest": longest, "first_over": first_over, "probes": probes}
    return found


def bisect_longest(fits, known: dict[int, bool], step: int) -> tuple[int, int]:
    """(the longest multiple of ``step`` that fits, the next one measured that does not), memory growing with
    length: between the longest length ``known`` to fit (0 if none) and the shortest longer one known not to,
    halving; with none known not to fit, doubling first. ``fits(length)`` measures a length not in ``known``."""
    def ok(length):
        if length not in known:
            known[length] = fits(length)
        return known[length]

    low = max([n for n, fit in known.items() if fit], default=0)
    high = min([n for n, fit in known.items() if not fit and n > low], default=None)
    while high is None:
        candidate = max(2 * low, step)
        if ok(candidate):
            low = candidate
        else:
            high = candidate
    while high - low > step:
        middle = max((low + high) // 2 // step * step, low + step)
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low, high


def balance(sizes=(2, 4, 8), windows=(None, 512)) -> list[dict]:
    """The zigzag's balance on the ANCHORS mix and on rows of a few long documents; the row cut in 2N chunks."""
    import torch

    from openpack.core.context_parallel import attention_work, split_row
    from openpack.core.packing import plan_packs
    from packing import generate_lengths

    mix = generate_lengths(600, seed=0).sft_rows()
    out = []
    for size in sizes:
        packs = [[int(mix[g]) for g in pack] for pack in plan_packs([[int(n)] for n in mix], 4096 * size).packs]
        few = _few_long_documents(8192 * size)
        for rows, kind in ((packs, f"ANCHORS mix, rows of {size} x 4096"), (few, f"1-4 documents, {size} x 8192")):
            for window in windows:
                zigzag, row_cut, tokens = [], [], []
                for lengths in rows:
                    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
                    shards = split_row(cu, size, window)
                    work = [attention_work(s, window) for s in shards]
                    zigzag.append(max(work) / np.mean(work))
                    tokens.append(max(s.num_tokens for s in shards) / np.mean([s.num_tokens for s in shards]))
                    row_cut.append(_row_cut_balance(lengths, size, window))
                out.append({"size": size, "rows": kind, "count": len(rows), "window": window,
                            "worst": max(zigzag), "mean": float(np.mean(zigzag)), "worst_tokens": max(tokens),
                            "row_cut_worst": max(row_cut), "row_cut_mean": float(np.mean(row_cut))})
    return out


def _few_long_documents(tokens: int, rows: int = 20) -> list[list[int]]:
    """Rows of ``tokens`` tokens, each 1 to 4 documents of random lengths (tests/unit/test_context_parallel_split.py's
    draw)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(rows):
        count = int(rng.integers(1, 5))
        out.append((rng.multinomial(tokens - count, rng.dirichlet(np.ones(count))) + 1).tolist())
    return out


def _row_cut_balance(lengths: list[int], size: int, window: int | None) -> float:
    """Largest / mean work when the row (not each document) is cut into 2N equal chunks, rank r holding chunks r
    and 2N-1-r, each token still seeing only its own document's keys."""
    work = np.concatenate([np.minimum(np.arange(1, n + 1), window or n) for n in lengths]).astype(np.float64)
    chunks = np.array_split(work, 2 * size)
    per_rank = [chunks[r].sum() + chunks[2 * size - 1 - r].sum() for r in range(size)]
    return max(per_rank) / np.mean(per_rank)


def check(args, work: Path) -> dict:
    """The split code path against the whole row: N = 1 (a single-rank group) and N = 2 on this device."""
    results = {}
    for name, ranks in (("split, 1 rank", 1), ("split, 2 ranks", 2)):
        run = launch(args, work, f"check_{ranks}", ranks, "check", split=True)
        if "ranks" not in run:
            results[name] = {"exit": run["exit"], "log": str(work / f"{run['name']}.log")}
            continue
        first = run["ranks"][0]
        results[name] = {key: first[key] for key in first if key not in ("rank", "held")}
        results[name]["held"] = [r["held"] for r in run["ranks"]]
    return results


# ---------------------------------------------------------------- docs


def sweep_table(runs: list[dict]) -> str:
    lines = ["| row (tokens) | arm | step memory per rank (MiB) | its peak (MiB) | its baseline (MiB) | step memory, "
             "glibc's heap (MiB) | tokens/s | 1 rank / ring 2: step memory | the same, glibc's heap "
             "| ring 2 / 1 rank: tokens/s | step-1 loss, grad norm |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for length in sorted({r["length"] for r in runs}):
        at = {arm: [r for r in runs if r["length"] == length and r["arm"] == arm] for arm in ARMS}

        def ratio(key, fmt="{:.2f}x", invert=False):
            values = [(b[key] / a[key]) if invert else (a[key] / b[key]) for a, b in zip(at["1 rank"], at["ring 2"])]
            return harness.fmt_spread(values, fmt)

        for arm, arm_runs in at.items():
            ratios = (f"{ratio('step_mb')} | {ratio('heap_step_mb')} | {ratio('tokens_per_s', invert=True)}"
                      if arm == "ring 2" else " | | ")
            cells = " | ".join(harness.fmt_spread([r[key] for r in arm_runs])
                               for key in ("step_mb", "peak_mb", "baseline_mb", "heap_step_mb", "tokens_per_s"))
            first = arm_runs[0]
            lines.append(f"| {length} | {arm} | {cells} | {ratios} | {first['loss']:.6f}, {first['grad_norm']:.6f} |")
    return "\n".join(lines)


def memory_growth(runs: list[dict], key: str = "step_mb") -> dict:
    """Per arm, how much step memory grows per 1000 tokens of the row between the two longest lengths measured
    (MiB; medians over repeats). Shorter rows are left out: the chunked LM head (``core.logprobs``, 2^26 logits a
    chunk: 2097 tokens at vocab 32000) holds up to two chunks' buffers at its peak, so its memory grows with a
    rank's tokens up to two chunks and then stays (measured alone, fp32, width 256: 299 MiB at 2048 tokens, 549 at
    4096, 567 at 8192)."""
    growth = {}
    for arm in ARMS:
        lengths = sorted({r["length"] for r in runs if r["arm"] == arm})
        if len(lengths) > 1:
            short, long = ([r[key] for r in runs if r["arm"] == arm and r["length"] == n] for n in lengths[-2:])
            growth[arm] = (harness.spread(long)[1] - harness.spread(short)[1]) / (lengths[-1] - lengths[-2]) * 1000
    return growth


def same_tokens_extra(runs: list[dict]) -> dict[int, float]:
    """Row length L -> a ring rank's step memory at L minus one rank's at L / 2 (the same number of tokens held):
    what splitting costs beyond holding half the row, the row's K/V above all (MiB; medians over repeats)."""
    def median(arm, length):
        values = [r["step_mb"] for r in runs if r["arm"] == arm and r["length"] == length]
        return harness.spread(values)[1] if values else None

    return {n: median("ring 2", n) - median("1 rank", n // 2) for n in sorted({r["length"] for r in runs})
            if median("ring 2", n) is not None and n % 2 == 0 and median("1 rank", n // 2) is not None}


def balance_table(rows: list[dict]) -> str:
    lines = ["| N | rows | window | zigzag: worst row, largest / mean work | zigzag: mean over rows "
             "| worst tokens largest / mean | row cut in 2N chunks: worst | row cut: mean |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['rows']} ({r['count']} rows) | {r['window'] or '—'} | {r['worst']:.4f} | "
                     f"{r['mean']:.4f} | {r['worst_tokens']:.4f} | {r['row_cut_worst']:.2f} | "
                     f"{r['row_cut_mean']:.2f} |")
    return "\n".join(lines)


def markdown_section(results: dict, chart: Path | None, doc: Path) -> str:
    """The docs section of one run, from its results.json alone (``--render`` writes it again without measuring)."""
    settings, runs, cap, rows = results["settings"], results["runs"], results["cap"], results["balance"]
    image = f"![context parallelism: memory and tokens/s]({os.path.relpath(chart, doc.parent)})\n\n" if chart else ""
    growth, heap = memory_growth(runs), memory_growth(runs, "heap_step_mb")
    lengths = sorted({r["length"] for r in runs})
    memory_line = ""
    if len(growth) == 2:
        memory_line = (f"Between {lengths[-2]} and {lengths[-1]} tokens step memory grows by "
                       f"{growth['1 rank']:.0f} MiB per 1000 tokens of the row on 1 rank and by "
                       f"{growth['ring 2']:.0f} MiB on each of 2 ranks: **{growth['1 rank'] / growth['ring 2']:.2f}x "
                       f"less per rank** (on glibc's heap {heap['1 rank']:.0f} and {heap['ring 2']:.0f} MiB, "
                       f"{heap['1 rank'] / heap['ring 2']:.2f}x).")
    extra = same_tokens_extra(runs)
    if extra:
        memory_line += (" A ring rank holding half of a row of L tokens holds "
                         + ", ".join(f"{mb:+.0f} MiB at {n}" for n, mb in extra.items())
                         + " against one rank holding a whole row of L / 2: splitting costs that, beyond holding "
                         "half the row.")
    cap_line = ""
    if cap:
        one, two = cap["1 rank"]["longest"], cap["ring 2"]["longest"]
        ratio = f"**{two / one:.2f}x**" if one else "no ratio (nothing fits on 1 rank)"
        cap_line = (f"**Longest sample under a cap of {settings['cap_mb']:.0f} MiB per rank** (whole-process peak "
                    "RSS, `VmHWM`, start-up included, of memory runs, measured against the cap; bisection in steps "
                    f"of {settings['resolution']} tokens, the sweep's memory runs as known points): "
                    f"{one} tokens on 1 rank (first over: {cap['1 rank']['first_over']}), {two} on 2 ranks (first "
                    f"over: {cap['ring 2']['first_over']}): {ratio}.\n\n")
    worst = max((r["worst"] for r in rows), default=float("nan"))
    threads = settings["threads"]
    return f"""## Context parallelism: one long row on 1 rank vs 2 ranks (`benchmarks/context_parallel.py`)

```
python benchmarks/context_parallel.py{(' ' + results['flags']) if results['flags'] else ''}
```

Machine: {results['machine']}; {results['code']}. Load average when it started: {results['load']}.
The script took {results['wall_s']:.0f} s. Model: {ModelSpec(**results['model']).describe()}; fp32. One training
step (forward, token-mean NLL, backward, the gradient summed over the context group, AdamW) on a row of one
document of L tokens, after a warm-up step on {WARMUP_TOKENS}; each rank its own process. Arms at the same
{threads} cores: 1 rank with {threads} threads, and `--ring_attn_size 2`'s split (per-document zigzag, K/V
all-gathered over gloo) on 2 ranks of {max(1, threads // 2)} thread(s). Each cell runs twice in fresh processes: a
memory run with glibc's `MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}` (every allocation of 64 KiB or more mapped on its
own and returned when freed, so resident memory follows the live tensors) and a timed run on glibc's default heap,
which keeps freed blocks resident (its step memory is shown too). Step memory: the rank's peak resident memory
during the step (`VmHWM`, reset after the warm-up) minus its resident memory just before it (model, gradients,
AdamW state); the tables show the larger rank. Tokens/s: L over the slower rank's step, from the timed run.
{settings['repeats']} run(s) per cell.

{sweep_table(runs)}

{memory_line}

{cap_line}**Balance of attention work** (`core.context_parallel.attention_work`: query-key pairs per rank, largest
over the mean of its group). Zigzag: each document cut in 2N chunks, the split this code uses; worst over all
rows {worst:.4f} (target: within 10% of the mean). Row cut: the row itself cut in 2N chunks, documents ignored for
the split (attention still per document).

{balance_table(rows)}

{image}What the numbers mean, and what to expect on GPUs: [docs/context_parallel.md](context_parallel.md)."""


def charts(path: Path, runs: list[dict]) -> None:
    lengths = sorted({r["length"] for r in runs})
    groups = [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths]

    def series(key, scale=1.0):
        return {arm: [[r[key] * scale for r in runs if r["arm"] == arm and r["length"] == n] for n in lengths]
                for arm in ARMS}

    harness.save_bar_charts(path, [
        Panel("step memory per rank (lower is better)", "MiB", groups, series("step_mb")),
        Panel("tokens / s, same cores (higher is better)", "tokens / s", groups, series("tokens_per_s")),
    ], "One long row: 1 rank vs --ring_attn_size 2 on 2 ranks (CPU)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, args.rank)
    if args.render is not None:  # the docs section and chart of an earlier run, measuring nothing
        write_docs(args, json.loads(args.render.read_text()))
        return 0
    return harness.run_in_work_folder(args, benchmark, None, "context_parallel_")


def benchmark(args, work: Path) -> int:
    started = time.perf_counter()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    if args.check:
        results = check(args, work)
        print(json.dumps(results, indent=1))
        (work / "results.json").write_text(json.dumps({"check": results}, indent=1))
        return 0
    print(f"lengths {args.length_list}, cap {args.cap_mb:.0f} MiB, {args.threads} threads; work folder {work}; "
          f"load {load}")
    rows = [] if args.no_balance else balance()
    print(balance_table(rows))
    runs = sweep(args, work)
    print(sweep_table(runs))
    cap = longest_under_cap(args, work, runs) if args.cap_mb else None
    if cap:
        print(json.dumps({arm: {k: v for k, v in found.items() if k != "probes"} for arm, found in cap.items()}))
    wall_s = time.perf_counter() - started
    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "spec"},
               "model": vars(args.spec), "machine": harness.machine_description(), "code": harness.code_description(),
               "flags": harness.given_flags(), "load": load, "balance": rows, "runs": runs,
               "growth": memory_growth(runs), "same_tokens_extra": same_tokens_extra(runs), "cap": cap,
               "wall_s": wall_s}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    write_docs(args, results)
    return 0


def write_docs(args, results: dict) -> None:
    if args.markdown is not None:
        charts(args.chart, results["runs"])
        harness.write_section(args.markdown, SECTION, markdown_section(results, args.chart, args.markdown))


if __name__ == "__main__":
    sys.exit(main())
