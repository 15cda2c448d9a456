"""RL --prefix_sharing on CPU: one training-side policy pass (forward + backward of the token log-probs) over a
rollout batch, prompt + completion per completion vs prompt | completion | ... per group, side by side.

    python benchmarks/rl_prefix_sharing.py                 # long prompts: 384 tokens, completions <= 64, n = 8
    python benchmarks/rl_prefix_sharing.py --smoke         # seconds: a tiny model and batch (CI)
    python benchmarks/rl_prefix_sharing.py --model 0.5b --device cuda --dtype bfloat16   # a GPU (torch varlen)
    python benchmarks/rl_prefix_sharing.py --rss --prompt_len 320 --completion_range 32 32 --max_tokens 1728
        # CPU memory: each arm's pass in a fresh process, its peak RSS above what the process held before it

``--rss`` is issue 42's case: rows capped at 1728 tokens (the automatic cap of a train_grpo run on that model),
where the unshared layout fits 4 prompt + completion copies a row and the shared one 3 whole groups, so a shared
row holds more tokens; its pass must still peak lower.

The model is grpo_vs_trl.py's random 9.8M Llama (fp32, random init), or with ``--model 0.5b`` gpu_mfu.py's
Qwen2.5-0.5B shape (vocabulary 151,936, tied embeddings; random init); the batch is random token ids: 4 prompts of
384 tokens x 8 completions of 16-64 tokens, packed into rows of at most --max_tokens. Each arm runs --repeats
timed passes after one warm-up, alternating arms; reported per arm: tokens computed, median seconds per pass, and
the two ratios. The pass is what every training-side pass (update, old policy, reference, critic) costs; the
step's other parts (generation, optimizer) are not here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from openpack.core.batch import collate_packed
from openpack.core.schedule import plan_scoring
from openpack.models.attention import resolve_backend, set_attention_backend
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import response_values


def batch_of(prompts: int, n: int, prompt_len: int, completion_range: tuple[int, int], vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt_tokens, completions = [], []
    for _ in range(prompts):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        for _ in range(n):
            length = int(torch.randint(completion_range[0], completion_range[1] + 1, (1,), generator=generator))
            prompt_tokens.append(prompt)
            completions.append(torch.randint(3, vocab, (length,), generator=generator).tolist())
    return Rollouts(prompt_tokens, completions, [[0.0] * len(c) for c in completions], [True] * len(completions))


def one_pass(module, rows, device: torch.device) -> None:
    module.zero_grad(set_to_none=True)
    for batch in rows:
        response_values(batch, module(batch)).float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=4, help="prompts in the rollout batch (8 completions each)")
    parser.add_argument("--model", choices=["9.8m", "0.5b"], default="9.8m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--attn_backend", default="auto", help="openpack's packed attention backend")
    parser.add_argument("--profile", action="store_true",
                        help="then one profiled pass per arm: forward alone timed, and torch.profiler's top ops")
    parser.add_argument("--prompt_len", type=int, default=384)
    parser.add_argument("--completion_range", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--rss", action="store_true",
                        help="CPU: each arm's peak RSS over one pass, measured in a process of its own")
    parser.add_argument("--arm", choices=["unshared", "prefix_sharing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss and args.arm is None:
        return rss_arms(args)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    set_attention_backend(args.attn_backend)
    if args.smoke:
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
        prompts, n, prompt_len, completion_range, repeats = 2, 4, 24, (2, 6), 1
    else:
        shape = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2)
        prompts, n, prompt_len, completion_range, repeats = (args.prompts, 8, args.prompt_len,
                                                             tuple(args.completion_range), args.repeats)
    if args.model == "0.5b" and not args.smoke:
        from gpu_mfu import SIZES, build

        model, vocab = build("0.5b", dtype, device, seed=0), SIZES["0.5b"]["vocab_size"]
        described = "Qwen2.5-0.5B shape: 24 layers, width 896"
    else:
        model, vocab = tiny_causal_lm("llama", vocab_size=64, max_position_embeddings=1024, **shape), 64
        model = model.to(device=device, dtype=dtype)
        described = f"Llama {shape['num_hidden_layers']} layers, width {shape['hidden_size']}"
    module = PackedCausalLM(model)
    rollouts = batch_of(prompts, n, prompt_len, completion_range, vocab, seed=0)
    arms = {}
    for name, shared in (("unshared", False), ("prefix_sharing", True)):
        if args.arm not in (None, name):
            continue
        units = Units(rollouts, shared, n, args.max_tokens)
        ids = units.add(range(len(rollouts.completion_tokens)))
        (rows,) = plan_scoring([units.lengths[u] for u in ids], 1, args.max_tokens)
        batches = [collate_packed([s for u in (ids[i] for i in row) for s in units.segments(u)]) for row in rows]
        arms[name] = {"rows": [b.to(device) for b in batches], "tokens": sum(b.num_tokens for b in batches), "times": []}
    if args.arm is not None:  # --rss: this process's one pass
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        one_pass(module, arms[args.arm]["rows"], device)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        arm = arms[args.arm]
        print(json.dumps({"tokens": arm["tokens"], "rows": len(arm["rows"]), "row_tokens": [b.num_tokens for b in
                          arm["rows"]], "before_mib": before / 1024, "peak_mib": peak / 1024}))
        return None
    for arm in arms.values():
        one_pass(module, arm["rows"], device)  # warm-up
    for _ in range(repeats):
        for arm in arms.values():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            one_pass(module, arm["rows"], device)
            arm["times"].append(time.perf_counter() - start)
            if device.type == "cuda":
                arm["peak_gib"] = max(arm.get("peak_gib", 0.0), torch.cuda.max_memory_allocated() / 2**30)
    params = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"model: {described}, {params / 1e6:.1f}M parameters, {args.dtype}, {where}, attention "
          f"{resolve_backend(device, dtype)}; batch: {prompts} prompts of {prompt_len} tokens x "
          f"{n} completions of {completion_range[0]}-{completion_range[1]} tokens; rows <= {args.max_tokens} tokens; "
          f"{repeats} timed passes per arm (median)")
    print("| arm | tokens computed | rows | s / pass (fwd + bwd) | peak memory (GiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, arm in arms.items():
        print(f"| {name} | {arm['tokens']} | {len(arm['rows'])} | {statistics.median(arm['times']):.3f} | "
              f"{arm.get('peak_gib', float('nan')):.1f} |")
    plain, shared = arms["unshared"], arms["prefix_sharing"]
    print(f"prefix sharing: {shared['tokens'] / plain['tokens']:.2f}x the tokens, "
          f"{statistics.median(shared['times']) / statistics.median(plain['times']):.2f}x the time per pass")
    if args.profile:
        for name, arm in arms.items():
            profile_pass(name, module, arm["rows"], device)


def rss_arms(args) -> None:
    """Each arm in a fresh process of one torch thread (the same model, batch and rows), one pass after the model
    and rows are built: the pass's peak RSS above the process's peak before it. CPU only."""
    forwarded = ["--max_tokens", str(args.max_tokens), "--prompts", str(args.prompts), "--prompt_len",
                 str(args.prompt_len), "--completion_range", *map(str, args.completion_range),
                 *(["--smoke"] if args.smoke else []), "--attn_backend", args.attn_backend, "--rss"]
    results = {}
    for arm in ("unshared", "prefix_sharing"):
        out = subprocess.run([sys.executable, __file__, *forwarded, "--arm", arm], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout
        results[arm] = json.loads(out.strip().splitlines()[-1])
    print(f"peak RSS of one pass (fwd + bwd), CPU, 1 thread; {args.prompts} prompts of {args.prompt_len} tokens x 8 "
          f"completions of {args.completion_range[0]}-{args.completion_range[1]} tokens; rows <= {args.max_tokens}")
    print("| arm | tokens computed | rows (tokens each) | peak RSS above the start (MiB) |")
    print("|---|---:|---|---:|")
    for arm, r in results.items():
        print(f"| {arm} | {r['tokens']} | {len(r['row_tokens'])} ({', '.join(map(str, r['row_tokens']))}) | "
              f"{r['peak_mib'] - r['before_mib']:.0f} |")
    plain, shared = (results[a]["peak_mib"] - results[a]["before_mib"] for a in ("unshared", "prefix_sharing"))
    print(f"prefix sharing: {shared / plain:.2f}x the unshared pass's peak memory")


def profile_pass(name: str, module, rows, device: torch.device) -> None:
    """The forward alone (no grad) timed, then one pass under torch.profiler: top ops by self device and by self
    host time (host syncs show as cudaStreamSynchronize / cudaMemcpyAsync rows)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        start = time.perf_counter()
        for batch in rows:
            module(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(f"\n{name}: forward alone (no grad) {time.perf_counter() - start:.3f} s")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one_pass(module, rows, device)
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=15, max_name_column_width=60))
    if device.type == "cuda":
        print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
