"""GPU: packed DPO (varlen attention) vs padded DPO (SDPA with a padding mask): tokens/s, step time, memory, MFU.

    python benchmarks/gpu_mfu.py [--sizes 0.5b 1.5b] [--steps 6] [--markdown docs/benchmarks.md]
    python benchmarks/gpu_mfu.py --smoke     # a tiny model on CPU: checks the script, measures nothing

Qwen2.5-0.5B- and 1.5B-shaped models (random init from config, bf16), a
frozen reference of the same shape, and preference pairs from the ANCHORS
benchmark length mix (token ids random). Each optimizer step trains
``--pairs_per_step`` pairs with the sigmoid DPO loss and AdamW, two ways:

* packed: pairs bin-packed into rows of at most ``--max_tokens`` tokens
  (``openpack.core.packing.plan_packs``), attention per segment through
  openpack's backend (``--attn_backend``, default torch_varlen);
* padded: 8 pairs per micro-batch (TRL's default), chosen and rejected
  right-padded to the longest of the 16 rows, transformers' SDPA with a
  padding mask.

Both use openpack's chunked log-probs (label tokens only), so the difference
is packing and the attention kernel. Reported per arm: real tokens/s, pairs/s,
s per step (median over steps after the first), peak allocated memory, and
MFU = model FLOPs of the real tokens / step time / peak. Model FLOPs count
2 x matmul parameters (LM head included) per token and per pass, plus causal
attention (2 x L^2 x width per layer and pass for a sequence of L tokens);
the policy makes 3 passes (forward, backward) and the reference 1. Padding is
not counted as useful work. The peak is the bf16 matmul rate measured on the
same GPU (8192^3 matmuls); the datasheet figure is printed beside it.

Runs without DeepSpeed, Ray or datasets (the GPU machine has none): plain
torch AdamW on bf16 weights, one process.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import generate_lengths  # noqa: E402

from openpack.core.batch import (  # noqa: E402
    CHOSEN,
    REJECTED,
    Segment,
    collate_packed,
    collate_padded,
    host_to_device,
)
from openpack.core.logprobs import pair_segments, segment_logprobs  # noqa: E402
from openpack.core.packing import plan_packs  # noqa: E402
from openpack.models.attention import register_packed_attention, set_attention_backend  # noqa: E402
from openpack.models.packed import PackedCausalLM  # noqa: E402

SIZES = {  # Qwen2.5 shapes; tied embeddings as in the released 0.5B and 1.5B
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "smoke": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True},
}
PADDED_PAIRS = 8  # TRL's default per_device_train_batch_size
DATASHEET_TFLOPS = {"H100": 989.0, "H200": 989.0}


def build(size: str, dtype, device, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", max_position_embeddings=4096, **SIZES[size])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_packed_attention(), dtype=dtype)
    return model.to(device)


def pairs_of(n: int, scale: int, vocab: int, seed: int) -> list[list[Segment]]:
    """n pairs [chosen, rejected] from the length mix (divided by ``scale``), random token ids."""
    lengths = generate_lengths(n, seed)
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for i, (p, c, r) in enumerate(zip(lengths.prompt, lengths.chosen, lengths.rejected)):
        p, c, r = max(1, int(p) // scale), max(2, int(c) // scale), max(2, int(r) // scale)
        prompt = torch.randint(vocab, (p,), generator=gen).tolist()
        pairs.append([Segment(prompt + torch.randint(vocab, (n_tok,), generator=gen).tolist(),
                              [False] * p + [True] * n_tok, i, role) for n_tok, role in ((c, CHOSEN), (r, REJECTED))])
    return pairs


def micro_batches(step_pairs: list[list[Segment]], packed: bool, max_tokens: int) -> list:
    if packed:
        plan = plan_packs([[len(s.tokens) for s in pair] for pair in step_pairs], max_tokens)
        return [collate_packed([s for g in pack for s in step_pairs[g]]) for pack in plan.packs]
    return [collate_padded([s for pair in step_pairs[i:i + PADDED_PAIRS] for s in pair])
            for i in range(0, len(step_pairs), PADDED_PAIRS)]


def dpo_step(policy, reference, optimizer, batches, pairs: int, beta: float, device) -> None:
    for batch in batches:
        # the pairs found in the host's segment table, as the trainers find them: no device sync
        chosen, rejected = (host_to_device(t, device) for t in pair_segments(batch)[1:])
        batch = batch.to(device)
        with torch.no_grad():
            ref = segment_logprobs(batch, reference(batch)).sum
        seg = segment_logprobs(batch, policy(batch)).sum
        margin = (seg[chosen] - ref[chosen]) - (seg[rejected] - ref[rejected])
        (-torch.nn.functional.logsigmoid(beta * margin).sum() / pairs).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def matmul_params(model) -> int:
    """Weights used as a matmul once per token: every ``nn.Linear``'s, each tensor once.

    A tied LM head is an ``nn.Linear`` whose weight is the embedding matrix: it counts once, as the head's matmul
    (the embedding lookup is no matmul). Until 2026-11-27 the embedding was added again for tied models, so the
    0.5B shape counted 630M matmul weights instead of 494M and its 0.5B MFU was 1.27x too high.
    """
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(weights.values())


def model_flops(model, step_pairs: list[list[Segment]]) -> float:
    """Useful FLOPs of one step: policy forward + backward (3 passes) and reference forward (1 pass)."""
    cfg = model.config
    weights = matmul_params(model)
    width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_pass = sum(2 * weights * len(s.tokens) + 2 * len(s.tokens) ** 2 * width * cfg.num_hidden_layers
                   for pair in step_pairs for s in pair)
    return 4 * per_pass


def matmul_peak(device, dtype, n: int = 8192, iters: int = 20) -> float:
    """Measured dense matmul TFLOP/s on this device (0 on CPU: no MFU there)."""
    if device.type != "cuda":
        return 0.0
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (time.perf_counter() - start) / 1e12


def run_arm(size: str, packed: bool, args, device, dtype, peak: float) -> dict:
    policy_model = build(size, dtype, device, seed=0).train()
    if args.gradient_checkpointing:
        policy_model.gradient_checkpointing_enable()
    reference_model = build(size, dtype, device, seed=0).eval()
    policy, reference = PackedCausalLM(policy_model), PackedCausalLM(reference_model)
    optimizer = torch.optim.AdamW(policy_model.parameters(), lr=1e-6, fused=device.type == "cuda")
    data = pairs_of(args.pairs_per_step * args.steps, args.scale, SIZES[size]["vocab_size"], args.seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, tokens, flops, slots = [], [], [], []
    try:
        for step in range(args.steps):
            step_pairs = data[step * args.pairs_per_step:(step + 1) * args.pairs_per_step]
            batches = micro_batches(step_pairs, packed, args.max_tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dpo_step(policy, reference, optimizer, batches, len(step_pairs), 0.1, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            tokens.append(sum(len(s.tokens) for pair in step_pairs for s in pair))
            slots.append(sum(b.input_ids.numel() for b in batches))
            flops.append(model_flops(policy_model, step_pairs))
    except torch.OutOfMemoryError:
        return {"size": size, "arm": "packed" if packed else "padded", "oom": True}
    finally:
        del policy, reference, policy_model, reference_model, optimizer
    rest = slice(1, None)  # the first step is warm-up
    step_s = statistics.median(times[rest])
    mean_tokens, mean_flops = statistics.mean(tokens[rest]), statistics.mean(flops[rest])
    result = {
        "size": size, "arm": "packed" if packed else "padded", "oom": False, "step_s": step_s,
        "tokens_per_s": mean_tokens / step_s, "pairs_per_s": args.pairs_per_step / step_s,
        "real_share": sum(tokens) / sum(slots), "tflops": mean_flops / step_s / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
    }
    result["mfu"] = result["tflops"] / peak if peak else float("nan")
    return result


def report(results: list[dict], args, device_name: str, peak: float, command: str) -> str:
    datasheet = next((v for k, v in DATASHEET_TFLOPS.items() if k in device_name), None)
    lines = [
        "## GPU: packed vs padded DPO, MFU (`benchmarks/gpu_mfu.py`)", "", "```", command, "```", "",
        f"Device: {device_name}; run on {datetime.date.today()}; torch {torch.__version__}. Measured bf16 matmul "
        f"peak {peak:.0f} TFLOP/s" + (f" (datasheet {datasheet:.0f})" if datasheet else "") + ". "
        f"{args.pairs_per_step} pairs per step from the ANCHORS length mix"
        + (f" divided by {args.scale}" if args.scale > 1 else "") + f", packed rows <= {args.max_tokens} tokens, "
        f"padded micro-batches of {PADDED_PAIRS} pairs; {args.steps} steps, the first not counted; gradient "
        f"checkpointing {'on' if args.gradient_checkpointing else 'off'}.", "",
        "| model | layout | real tokens/s | pairs/s | s / step | real / computed tokens | peak memory (GiB) | "
        "model TFLOP/s | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["oom"]:
            lines.append(f"| {r['size']} | {r['arm']} | out of memory | | | | | | |")
            continue
        lines.append(f"| {r['size']} | {r['arm']} | {r['tokens_per_s']:.0f} | {r['pairs_per_s']:.2f} | "
                     f"{r['step_s']:.3f} | {r['real_share']:.1%} | {r['peak_gib']:.1f} | {r['tflops']:.0f} | "
                     f"{r['mfu']:.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=[s for s in SIZES if s != "smoke"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs_per_step", type=int, default=64)
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--scale", type=int, default=1, help="divide every length of the mix by this")
    parser.add_argument("--attn_backend", default="torch_varlen", help="openpack backend of the packed arm")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, help="replace the gpu_mfu section of this file")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, fp32, sdpa: checks the script")
    args = parser.parse_args()
    command = "python benchmarks/gpu_mfu.py " + " ".join(sys.argv[1:])
    if args.smoke:
        args.sizes, args.steps, args.pairs_per_step, args.max_tokens, args.scale = ["smoke"], 2, 8, 512, 8
        args.attn_backend = "sdpa"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run, no MFU)"
    set_attention_backend(args.attn_backend)
    peak = matmul_peak(device, dtype)
    results = []
    for size in args.sizes:
        for packed in (True, False):
            results.append(run_arm(size, packed, args, device, dtype, peak))
            print(results[-1], flush=True)
    section = report(results, args, device_name, peak, command.strip())
    print(section)
    if args.markdown:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import harness

        harness.write_section(args.markdown, "gpu_mfu", section)


if __name__ == "__main__":
    main()
