"""One rank of test_context_parallel.py: ``python context_parallel_script.py RANK WORLD PORT OUT.json``.

For each case of ``CASES`` the rank builds the tiny model and the packed row, runs its part of the split row
(log-probs, then the gradient of a weighted sum of them, its local part only), sums log-probs and gradients over
the group, and compares them with the unsplit row's. Rank 0 writes the largest errors to OUT.json.
"""

import json
import sys

import torch
import torch.distributed as dist

from openpack.core.batch import collate_packed
from openpack.core.context_parallel import shard_batch, split_row
from openpack.models.context_parallel import set_context_group
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.models.verify import random_segments

# A 64-token row over 2 ranks of 32: the 40-token document is longer than a rank's share and straddles the split;
# document 3 (one token, an odd index) lies on rank 1 only (test_context_parallel.py checks both from the split).
LENGTHS = [9, 40, 3, 1, 11]
# name -> (tiny architecture, config overrides, the window the split balances for, whether document boundaries are
# ignored: the whole row split as one document, the mistake a ring without cu_seqlens makes)
CASES = {
    "llama": ("llama", {}, None, False),
    "qwen2_sliding_window": ("qwen2_sliding_window", {}, 8, False),
    "llama_gqa_8_over_2": ("llama", dict(num_attention_heads=8, num_key_value_heads=2), None, False),
    "gemma2_softcap": ("gemma2", {}, None, False),
    "llama_dynamic_rope": ("llama_dynamic_rope", {}, None, False),
    "llama_boundaries_ignored": ("llama", {}, None, True),
}


def run_case(arch, overrides, window, ignore_boundaries, rank, world):
    model = tiny_causal_lm(arch, seed=0, **overrides)
    packed = PackedCausalLM(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = collate_packed(random_segments(LENGTHS, model.config.vocab_size, seed=7))
    weights = torch.linspace(0.5, 1.5, batch.num_tokens)  # a weighted sum, so every position matters

    reference = packed(batch)
    reference_grads = torch.autograd.grad((reference * weights).sum(), params)

    cu_seqlens = torch.tensor([0, batch.num_tokens], dtype=torch.int32) if ignore_boundaries else batch.cu_seqlens
    shard = split_row(cu_seqlens, world, window)[rank]
    local = packed(shard_batch(batch, shard))
    grads = torch.autograd.grad((local * weights[shard.token_index]).sum(), params)
    logprobs = torch.zeros(batch.num_tokens).index_put_((shard.token_index,), local.detach())
    dist.all_reduce(logprobs)
    for g in grads:
        dist.all_reduce(g)
    return {
        "logprob_error": (logprobs - reference).abs().max().item(),
        "grad_error": max((a - b).abs().max().item() for a, b in zip(grads, reference_grads)),
        "grad_scale": max(b.abs().max().item() for b in reference_grads),
    }


def main(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    set_context_group(dist.group.WORLD)
    results = {name: run_case(*case, rank, world) for name, case in CASES.items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    set_context_group(None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
