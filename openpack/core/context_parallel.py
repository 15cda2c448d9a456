"""Context parallelism: the N ranks of a context group share one packed row (``--ring_attn_size N``).

The split is a **per-document zigzag**: every document (segment) of the row is
cut into 2N chunks and rank r holds chunks r and 2N-1-r of each. Under causal
attention chunk i of a document does work growing with i (its queries see
more keys), so each pair (r, 2N-1-r) does the same work, whatever the mix of
document lengths. A row of 3 documents over N = 2 ranks (chunks a0..a3 of
document a, and so on; ``[r]`` is the rank holding a chunk)::

    row        | a0  a1  a2  a3 | b0 b1 b2 b3 | c0 c1 c2 c3 |
    rank       | [0] [1] [1] [0]| [0][1][1][0]| [0][1][1][0]|
    rank 0:  a0 a3 b0 b3 c0 c3       rank 1:  a1 a2 b1 b2 c1 c2   (a1 a2 touch: one piece)

Cutting the *row* into 2N chunks instead (a ring over the concatenated row)
balances only when the documents are many and short: with a 6000- and a
2192-token document over 2 ranks the loads are 4.5M and 15.9M query-key pairs.

Each rank holds L // N tokens of a document of L (the L % N leftovers go to
the ranks from the document's index mod N on, so they rotate and tokens per
rank differ by at most one per document). Where in the document its two chunks
sit is searched so the pair carries 1/N of the document's work, counted as
min(position + 1, window) keys per token: for plain causal attention that is
the equal-chunk zigzag above; with a sliding window shorter than the document
the first chunk grows, since its tokens see fewer keys (the plain zigzag was
up to 1.29x the mean on the mix below with a 512-token window). The largest
rank's work is at most 1.009x the mean of its group on every row of the
ANCHORS length mix packed into rows of N x 4096 tokens (N = 2, 4, 8; with and
without a 512-token window) and 1.0002x on rows of 1 to 4 long documents
(tests/unit/test_context_parallel_split.py). A document shorter than 2N sits
on a few ranks only, and may start on any rank.

A rank's tokens are ordered by document, then position, so each document's
local tokens are contiguous: the local row is a PackedBatch with the same
segment table (``cu_seqlens`` over the local tokens, some segments empty) and
the positions, labels and loss mask of the whole row (labels were shifted
before the split). The attention of a local *piece* (a run of consecutive
positions of one document) reads the keys of its document from its first
position (or a sliding window before it) up to its own last token, gathered
from all ranks (``models/context_parallel.py``).
"""

from __future__ import annotations

import torch

from openpack.core.batch import ContextShard, PackedBatch


def key_rows(shard: ContextShard, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The keys each piece of ``shard`` attends to, as rows of the all-gathered buffer: (rows [K] int64, cu_seqlens_k
    [P + 1] int32, max_seqlen_k).

    Piece p's keys are its segment's positions ``first .. offset + length - 1``, with ``first`` 0, or with a
    ``window`` the earliest key its first query may see. Its queries are the last ``length`` of those keys,
    so causal attention aligned to the bottom-right corner, and a window counted back from each query, are
    exact in position space (the shape of ``models.attention``'s prefix-sharing cross call).
    """
    end = shard.piece_offset + shard.piece_length
    first = (shard.piece_offset - window + 1).clamp(min=0) if window else torch.zeros_like(end)
    lengths = end - first
    cu_k = _cumulative(lengths)
    total = int(cu_k[-1])
    # row of key i of piece p = (row of the piece's first key - cu_k[p]) + i
    rows = _expand(shard.segment_starts[shard.piece_segment] + first - cu_k[:-1], cu_k, total)
    rows += torch.arange(total, device=rows.device)
    return shard.gathered_index[rows], cu_k, int(lengths.max()) if lengths.numel() else 0


def _expand(values: torch.Tensor, cu: torch.Tensor, total: int) -> torch.Tensor:
    """``values[p]`` for each of the ``total`` rows ``cu[p] .. cu[p + 1] - 1`` (every run non-empty): a cumulative
    sum of steps. ``repeat_interleave`` with a tensor of counts took 8-16 ms for 8000 rows on this 2-core CPU
    (torch 2.13), 50x longer, and this runs in every layer."""
    steps = torch.zeros(total, dtype=values.dtype, device=values.device)
    if total:
        steps[cu[:-1].long()] = torch.cat([values[:1], values.diff()])
    return steps.cumsum(0)


def split_row(cu_seqlens: torch.Tensor, size: int, window: int | None = None) -> list[ContextShard]:
    """The per-document zigzag split (module docstring) of a row with segment boundaries ``cu_seqlens`` [S + 1]
    over ``size`` ranks: one ContextShard per rank, balanced for attention with a sliding ``window`` (None: full
    causal attention)."""
    if size < 1:
        raise ValueError(f"context parallel size must be >= 1, got {size}")
    bounds = cu_seqlens.tolist()
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(size)]  # per rank: (segment, offset, length)
    for segment, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        for rank, (offset, length) in enumerate(_zigzag(end - start, size, segment, window)):
            pieces[rank].extend((segment, o, n) for o, n in _merged(offset, length) if n)
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    lengths = torch.tensor(bounds[1:], dtype=torch.int64) - starts
    token_index = [_piece_tokens(rank_pieces, starts) for rank_pieces in pieces]
    max_local = max(t.numel() for t in token_index)
    gathered_index = torch.empty(int(bounds[-1]), dtype=torch.int64)
    for rank, tokens in enumerate(token_index):
        gathered_index[tokens] = rank * max_local + torch.arange(tokens.numel())
    shards = []
    for rank, rank_pieces in enumerate(pieces):
        table = torch.tensor(rank_pieces, dtype=torch.int64).reshape(-1, 3)
        shards.append(ContextShard(
            rank=rank, size=size, token_index=token_index[rank],
            piece_segment=table[:, 0], piece_offset=table[:, 1], piece_length=table[:, 2],
            cu_seqlens_q=_cumulative(table[:, 2]), max_seqlen_q=int(table[:, 2].max()) if len(table) else 0,
            segment_starts=starts, segment_lengths=lengths, gathered_index=gathered_index, max_local_tokens=max_local,
        ))
    return shards


def _zigzag(length: int, size: int, segment: int, window: int | None) -> list[tuple[list[int], list[int]]]:
    """Per rank, the (offsets, lengths) of its two chunks of a segment of ``length``: the outermost pair of what
    is left for rank 0, the next pair inwards for rank 1, and so on (chunks r and 2N-1-r).

    Each rank's tokens are fixed first (L // N, plus the leftovers rotated by ``segment``); then its head chunk's
    length ``a`` is searched so that the pair's work is the remaining work over the remaining ranks. That work
    falls as ``a`` grows (tokens move from the heavy tail to the light head), so a binary search finds it.
    """
    base, extra = divmod(length, size)
    tokens = [base + ((rank - segment) % size < extra) for rank in range(size)]
    lo, hi, chunks = 0, length, []
    for rank, held in enumerate(tokens):
        target = (_work_before(hi, window) - _work_before(lo, window)) / (size - rank)

        def pair_work(a):  # rank holds [lo, lo + a) and [hi - held + a, hi)
            tail_start = hi - held + a
            return (_work_before(lo + a, window) - _work_before(lo, window) + _work_before(hi, window)
                    - _work_before(tail_start, window))

        left, right = 0, held  # the smallest a with pair_work(a) <= target; then the closer of a - 1 and a
        while left < right:
            middle = (left + right) // 2
            left, right = (left, middle) if pair_work(middle) <= target else (middle + 1, right)
        if left and pair_work(left - 1) - target < target - pair_work(left):
            left -= 1
        chunks.append(([lo, hi - held + left], [left, held - left]))
        lo, hi = lo + left, hi - held + left
    return chunks


def _work_before(position: int, window: int | None) -> int:
    """Query-key pairs of a document's first ``position`` tokens: token p sees min(p + 1, window) keys."""
    if not window or position <= window:
        return position * (position + 1) // 2
    return window * (window + 1) // 2 + (position - window) * window


def _merged(offsets: list[int], lengths: list[int]) -> list[tuple[int, int]]:
    """A rank's two chunks of a segment, as one piece when they touch (the middle rank's, N-1 and N)."""
    if offsets[0] + lengths[0] == offsets[1] or lengths[0] == 0 or lengths[1] == 0:
        first = offsets[0] if lengths[0] else offsets[1]
        return [(first, lengths[0] + lengths[1])]
    return list(zip(offsets, lengths))


def _piece_tokens(pieces: list[tuple[int, int, int]], starts: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(n) + int(starts[s]) + o for s, o, n in pieces])


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def shard_batch(batch: PackedBatch, shard: ContextShard) -> PackedBatch:
    """This rank's part of ``batch``: its tokens with their positions, labels and loss mask, the whole row's
    segment table, and ``context_shard`` set so that attention reads keys from the whole row."""
    if batch.shared_prefix is not None:
        raise ValueError("context parallelism does not split prefix-shared rows; turn --prefix_sharing off")
    index = shard.token_index.to(batch.input_ids.device)
    per_segment = torch.zeros(batch.num_segments, dtype=torch.int64)
    per_segment.index_add_(0, shard.piece_segment, shard.piece_length)
    return PackedBatch(
        input_ids=batch.input_ids[:, index],
        position_ids=batch.position_ids[:, index],
        labels=batch.labels[:, index],
        loss_mask=batch.loss_mask[:, index],
        segment_ids=batch.segment_ids[index],
        cu_seqlens=_cumulative(per_segment),
        max_seqlen=int(per_segment.max()),
        sample_index=batch.sample_index,
        role=batch.role,
        context_shard=shard,
    )


def held_labels(loss_mask: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Which of a row's labelled tokens ``shard`` holds, in its local order: [N_r] int64 indices into the row's
    labelled tokens counted in row order (``loss_mask`` [T] bool of the whole row). A rank's tokens keep row order
    (``split_row``), so per-token values of the whole row's labels, indexed by this, are the local labels'::

        loss_mask   0 1 1 1 | 0 1 1        labelled tokens 0..4 in row order
        rank 0      ^     ^ | ^   ^        token_index [0, 3, 4, 6] -> held_labels [2, 4]
    """
    mask = loss_mask.reshape(-1).bool()
    index = shard.token_index.to(mask.device)
    return (mask.cumsum(0) - 1)[index][mask[index]]


def attention_work(shard: ContextShard, window: int | None = None) -> int:
    """Query-key pairs this rank's causal attention computes: each token sees its position + 1 keys of its
    document (at most ``window``)."""
    pieces = zip(shard.piece_offset.tolist(), shard.piece_length.tolist())
    return sum(_work_before(offset + length, window) - _work_before(offset, window) for offset, length in pieces)
