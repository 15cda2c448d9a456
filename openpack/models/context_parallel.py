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

Pair losses (DPO, reward models) are not linear in tokens, so a rank's part of a segment's log-prob sum, or a
reward read at a last token that another rank holds, is combined over the group before the loss
(``whole_segment_values``, ``last_token_readout``): every rank of the group then computes the same pair losses.
Online RL's per-completion quantities (GSPO's sequence ratio, a geometric-mean rollout correction) sum their parts
the same way, and its scoring passes (old policy, reference, critic) gather each rank's per-token values back into
the whole row (``whole_row_values``), so the experience is the unsplit row's.
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


def whole_segment_values(batch, partial: torch.Tensor) -> torch.Tensor:
    """Per-segment values [S] of the whole row from this rank's part of them (log-prob sums, label counts, a reward
    read where this rank holds it and 0 elsewhere): summed over the context group when ``batch`` is one rank's part
    of a split row, else ``partial`` as it is.

    The gradient passes through unchanged, not summed: every rank of the group computes the same loss from the
    same sums, so d loss / d partial on rank r is d loss / d sum, and the ranks' parameter gradients, added over
    the group as DeepSpeed does over the world, are the whole row's (the chain rule through sum = sum_r partial_r).
    Summing the gradients too would count each loss N times.
    """
    if getattr(batch, "context_shard", None) is None:
        return partial
    _check_group(batch.context_shard)
    return _SumOverGroup.apply(partial, _group)


def last_token_readout(batch, skip_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each segment's last token sits among this rank's tokens, for one rank's part of a split row: (index
    [S] int64 into the local tokens, held [S] bool: whether this rank holds it; index 0 where it does not).

    ``core.batch.last_token_index``'s rule on the whole row (the last token whose id is not ``skip_token_id``):
    each rank finds its own last such token of every segment by its offset in the segment, and the group's
    maximum (one all-reduce of [S] int64) says which rank holds the segment's. Under the zigzag split that is
    usually rank 0 (it holds every document's tail), but a short document, or one ending in skipped tokens,
    ends on another rank.
    """
    shard = batch.context_shard
    _check_group(shard)
    ids = batch.input_ids.flatten()
    segments = batch.segment_ids.to(ids.device)
    real = torch.ones_like(ids, dtype=torch.bool) if skip_token_id is None else ids != skip_token_id
    offset = shard.token_index.to(ids.device) - shard.segment_starts.to(ids.device)[segments]
    local = torch.arange(ids.numel(), device=ids.device)
    none = torch.full((batch.num_segments,), -1, dtype=torch.int64, device=ids.device)
    mine = none.scatter_reduce(0, segments, torch.where(real, offset, -1), reduce="amax")
    index = none.scatter_reduce(0, segments, torch.where(real, local, -1), reduce="amax")
    whole = mine.clone()
    dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=_group)
    if (whole < 0).any():
        bad = (whole < 0).nonzero()[0].item()
        raise ValueError(f"segment {bad} (sample {batch.sample_index[bad].item()}) has no token to read a value at")
    return index.clamp(min=0), (mine == whole)


@torch.no_grad()
def whole_row_values(batch, local: torch.Tensor) -> torch.Tensor:
    """Per-token values of the whole row [T] from this rank's [T_r] (a scoring pass: no gradient), gathered over
    the context group when ``batch`` is one rank's part of a split row, else ``local`` as it is."""
    shard = getattr(batch, "context_shard", None)
    if shard is None:
        return local.reshape(-1)
    gathered = all_gather_rows(local.reshape(-1), shard)
    return gathered[shard.gathered_index.to(gathered.device)]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` in the forward; the identity in the backward (``whole_segment_values``)."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather_rows(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Every rank's ``local`` [T_r, ...] in one buffer [N x max_local_tokens, ...]: rank q's rows from
    q x max_local_tokens on, zero-padded (``shard.gathered_index`` says where each row position landed)."""
    _check_group(shard)
    return _AllGatherRows.apply(local, shard.max_local_tokens, _group)


def _check_group(shard: ContextShard) -> None:
    if _group is None:
        raise RuntimeError("one rank's part of a split row (a context-parallel batch) met no context group "
                           "(openpack.models.context_parallel.set_context_group)")
    size, rank = dist.get_world_size(_group), dist.get_rank(_group)
    if (size, rank) != (shard.size, shard.rank):
        raise RuntimeError(f"the batch's context shard is rank {shard.rank} of {shard.size}, but this process is "
                           f"rank {rank} of a context group of {size}")


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
