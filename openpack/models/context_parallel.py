"""The all-gather of keys and values across a context group (``--ring_attn_size N``), as in Llama 3's training.

A packed row is split over the N ranks of a context group (``core.context_parallel``). In every attention
layer each rank all-gathers the keys and values of the whole row from the group, one collective for K and V
together, then its queries attend to exactly the keys of their own document up to themselves
(``models.attention``: each local piece is a block of queries at the bottom-right corner of its keys).

What it costs, per layer and rank: K and V of the whole row, ``N x max_local_tokens x 2 Hkv x D`` (O(row)
memory, as the unsplit row's own K/V), one all-gather receiving (N-1)/N of it, and in the backward one
reduce-scatter of their gradients (a rank's queries send gradient to keys held by others): NCCL's
``reduce_scatter_tensor``, or on gloo ``all_to_all_single`` plus a sum of the N blocks received. Nothing
overlaps with compute. Llama 3 chose this over ring attention (K/V blocks passed N-1 times, overlapped with
compute) because with grouped-query attention K and V are small next to the queries, and because document
masks make a ring's steps uneven. A ring holds two blocks at a time where this holds the row; rows far
longer than activations allow would need one (not done).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from openpack.core.batch import ContextShard

_group: dist.ProcessGroup | None = None


def set_context_group(group: dist.ProcessGroup | None) -> None:
    """The process group whose ranks share this rank's packed rows (None: no context parallelism)."""
    global _group
    _group = group


def all_gather_rows(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Every rank's ``local`` [T_r, ...] in one buffer [N x max_local_tokens, ...]: rank q's rows from
    q x max_local_tokens on, zero-padded (``shard.gathered_index`` says where each row position landed)."""
    if _group is None:
        raise RuntimeError("a context-parallel batch reached attention with no context group set "
                           "(openpack.models.context_parallel.set_context_group)")
    size, rank = dist.get_world_size(_group), dist.get_rank(_group)
    if (size, rank) != (shard.size, shard.rank):
        raise RuntimeError(f"the batch's context shard is rank {shard.rank} of {shard.size}, but this process is "
                           f"rank {rank} of a context group of {size}")
    return _AllGatherRows.apply(local, shard.max_local_tokens, _group)


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0 of tensors padded to ``rows``; the backward sums each rank's block over the group
    (a reduce-scatter) and keeps this rank's unpadded rows."""

    @staticmethod
    def forward(ctx, local, rows, group):
        ctx.group, ctx.held = group, local.shape[0]
        size = dist.get_world_size(group)
        padded = torch.cat([local, local.new_zeros((rows - local.shape[0], *local.shape[1:]))]).contiguous()
        if dist.get_backend(group) == "nccl":
            out = local.new_empty((size * rows, *local.shape[1:]))
            dist.all_gather_into_tensor(out, padded, group=group)
            return out
        blocks = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(blocks, padded, group=group)
        return torch.cat(blocks)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        size = dist.get_world_size(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            mine = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad, group=group)
        else:  # gloo has no reduce-scatter: block q goes to rank q, which sums what it receives
            received = torch.empty_like(grad)
            dist.all_to_all_single(received, grad, group=group)
            mine = received.view(size, -1, *grad.shape[1:]).sum(0)
        return mine[:ctx.held], None, None
