"""The per-document zigzag split of a packed row over a context group (``core/context_parallel.py``).

Balance is the largest rank's causal attention work (query-key pairs) over the mean of the group's ranks,
per row; measured (2026-11-27) on 600 ANCHORS SFT rows packed into rows of N x 4096 tokens, the worst row:
N = 2: 1.0032, N = 4: 1.0055, N = 8: 1.0089, the same with a 512-token window; tokens per rank at most
1.0027x the mean. Rows of 1 to 4 long documents (N x 8192 tokens): at most 1.0002 (window 4096: 1.0001).
Cutting the row instead of each document into 2N chunks gives 4.5M vs 15.9M pairs on a 6000 + 2192 row.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openpack.core.batch import Segment, collate_packed
from openpack.core.context_parallel import attention_work, held_labels, key_rows, shard_batch, split_row
from openpack.core.packing import plan_packs
from test_benchmark_packing import bench  # benchmarks/packing.py, loaded from its path


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def _balance(lengths, size, window=None) -> tuple[float, float]:
    """(largest / mean attention work, largest / mean tokens) over the ranks of one split row."""
    shards = split_row(_cu(lengths), size, window)
    work = [attention_work(s, window) for s in shards]
    tokens = [s.num_tokens for s in shards]
    return max(work) / np.mean(work), max(tokens) / np.mean(tokens)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), size=st.integers(1, 8),
       window=st.one_of(st.none(), st.integers(1, 16)))
def test_every_token_on_exactly_one_rank(lengths, size, window):
    shards = split_row(_cu(lengths), size, window)
    total = sum(lengths)
    held = torch.cat([s.token_index for s in shards])
    assert torch.equal(held.sort().values, torch.arange(total))
    # tokens per rank differ by at most one per segment (the leftovers of L / N rotate over ranks)
    counts = [s.num_tokens for s in shards]
    assert max(counts) - min(counts) <= len(lengths)
    for s in shards:  # the piece table describes the tokens: consecutive positions of one segment, in order
        starts = s.segment_starts[s.piece_segment] + s.piece_offset
        expected = [torch.arange(n) + int(a) for a, n in zip(starts, s.piece_length)]
        assert torch.equal(s.token_index, torch.cat(expected) if expected else torch.zeros(0, dtype=torch.int64))
        assert torch.equal(s.cu_seqlens_q[1:].long(), s.piece_length.cumsum(0))
        assert bool((s.piece_length > 0).all())
        rank_rows = s.gathered_index[s.token_index]  # this rank's tokens fill its block of the gathered buffer
        assert torch.equal(rank_rows, s.rank * s.max_local_tokens + torch.arange(s.num_tokens))


def test_plain_causal_split_is_the_zigzag():
    """A 16-token document over 2 ranks: 4 chunks of 4, rank 0 holds the first and last, rank 1 the middle two
    (merged into one piece). Over 4 ranks: 8 chunks of 2, rank r holds chunks r and 7 - r."""
    two = split_row(_cu([16]), 2)
    assert two[0].token_index.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert two[1].token_index.tolist() == list(range(4, 12))
    assert (two[0].piece_offset.tolist(), two[1].piece_offset.tolist()) == ([0, 12], [4])
    four = split_row(_cu([16]), 4)
    assert [s.token_index.tolist() for s in four] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                      [6, 7, 8, 9]]
    assert len({attention_work(s) for s in four}) == 1  # 34 pairs each


def test_window_moves_the_cuts():
    """With a window of 4 on a 16-token document, tokens 4.. each do 4 units of work and 0..3 do 1, 2, 3, 4: the
    plain zigzag would give rank 0 (tokens 0-3, 12-15) 26 units and rank 1 32; the split moves rank 0's head
    chunk so both do 29 units or as close as whole tokens allow."""
    shards = split_row(_cu([16]), 2, window=4)
    work = [attention_work(s, 4) for s in shards]
    assert [s.num_tokens for s in shards] == [8, 8]
    assert abs(work[0] - work[1]) <= 4 and work != [26, 32]


def test_short_documents_rotate_over_ranks():
    """Leftover tokens of L / N go to the ranks from (segment index mod N) on, so one-token documents alternate
    and documents 1 and 3 start on the second rank. Each rank does 7 units: rank 0 holds document 0, positions 0
    and 1 of document 2 (1 + 2) and position 2 of document 3 (3); rank 1 the mirror image."""
    shards = split_row(_cu([1, 1, 3, 3]), 2)
    assert shards[0].token_index.tolist() == [0, 2, 3, 7]
    assert shards[1].token_index.tolist() == [1, 4, 5, 6]
    assert [attention_work(s) for s in shards] == [7, 7]


def test_key_rows_start_at_the_document_or_the_window():
    """Row [5 | 3] over 2 ranks. Rank 0 holds positions 0, 1 and 4 of segment 0 (1 + 2 + 5 = 8 of its 15 units)
    and position 2 of segment 1 (rows 0, 1, 4, 7); rank 1 rows 2, 3, 5, 6. In the gathered buffer (2 x 4 rows)
    rank 0's tokens are rows 0-3 and rank 1's rows 4-7. Rank 0's pieces read positions 0-1 and 0-4 of segment 0
    and 0-2 of segment 1; with a window of 2, positions 0-1, 3-4 and 1-2."""
    shards = split_row(_cu([5, 3]), 2)
    assert shards[0].token_index.tolist() == [0, 1, 4, 7] and shards[1].token_index.tolist() == [2, 3, 5, 6]
    gathered = shards[0].gathered_index
    assert gathered.tolist() == [0, 1, 4, 5, 2, 6, 7, 3] and shards[0].max_local_tokens == 4
    rows, cu_k, max_k = key_rows(shards[0])
    assert rows.tolist() == gathered[[0, 1, 0, 1, 2, 3, 4, 5, 6, 7]].tolist()
    assert cu_k.tolist() == [0, 2, 7, 10] and max_k == 5
    rows, cu_k, max_k = key_rows(shards[0], window=2)
    assert rows.tolist() == gathered[[0, 1, 3, 4, 6, 7]].tolist() and cu_k.tolist() == [0, 2, 4, 6] and max_k == 2


def test_shard_batch_keeps_positions_and_shifted_labels():
    segments = [Segment(list(range(10, 15)), [False, True, True, True, True], 0),
                Segment([20, 21, 22], [False, True, True], 1)]
    batch = collate_packed(segments)
    shards = split_row(batch.cu_seqlens, 2)
    local = shard_batch(batch, shards[1])
    index = shards[1].token_index
    assert torch.equal(local.position_ids[0], batch.position_ids[0, index])
    assert torch.equal(local.labels[0], batch.labels[0, index])  # shifted before the split
    assert local.cu_seqlens.tolist() == [0, 2, 4] and local.num_segments == batch.num_segments
    assert local.attention_kwargs()["context_shard"] is shards[1]
    assert sum(shard_batch(batch, s).loss_mask.sum() for s in shards) == batch.loss_mask.sum()


def test_held_labels_on_a_hand_split_row():
    """Two completions after prompts (labels shifted: a target's label sits on the token before it), the second an
    episode with a hole. Labelled positions of the row: 1, 2, 3 (segment 0) and 6, 9 (segment 1), labels 0..4 in row
    order. Over 2 ranks rank 0 holds the heads and tails: positions 0, 1 | 4 of segment 0 (3 of its 5 tokens, the
    leftover), 5, 6 | 10 of segment 1; rank 1 the middles 2, 3 and 7, 8, 9. So rank 0 holds labels 0 (position 1)
    and 3 (position 6), rank 1 labels 1, 2 (positions 2, 3) and 4 (position 9)."""
    segments = [Segment(list(range(10, 15)), [False, False, True, True, True], 0),
                Segment(list(range(20, 26)), [False, False, True, False, False, True], 1)]
    batch = collate_packed(segments)
    assert batch.loss_mask[0].nonzero()[:, 0].tolist() == [1, 2, 3, 6, 9]
    shards = split_row(batch.cu_seqlens, 2)
    assert [s.token_index.tolist() for s in shards] == [[0, 1, 4, 5, 6, 10], [2, 3, 7, 8, 9]]
    assert [held_labels(batch.loss_mask, s).tolist() for s in shards] == [[0, 3], [1, 2, 4]]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), size=st.integers(1, 4), seed=st.integers(0, 99))
def test_held_labels_pick_each_rank_s_own_labels(lengths, size, seed):
    """Per-label values of the whole row (as a scoring pass gathers them), indexed by a rank's ``held_labels``, are
    that rank's labelled tokens' values in its order; every label is held once over the group."""
    generator = torch.Generator().manual_seed(seed)
    segments = [Segment(list(range(n)), (torch.rand(n, generator=generator) < 0.6).tolist(), k)
                for k, n in enumerate(lengths)]
    batch = collate_packed(segments)
    per_token = torch.randn(batch.num_tokens, generator=generator)
    whole = per_token[batch.loss_mask[0]]
    held = []
    for shard in split_row(batch.cu_seqlens, size):
        local = shard_batch(batch, shard)
        mine = held_labels(batch.loss_mask, shard)
        assert torch.equal(whole[mine], per_token[shard.token_index][local.loss_mask[0]])
        held.append(mine)
    assert sorted(torch.cat(held).tolist()) == list(range(whole.numel()))


@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_balance_on_the_anchors_mix(size, window):
    rows = bench.generate_lengths(600, seed=0).sft_rows()  # the ANCHORS length mix
    plan = plan_packs([[int(n)] for n in rows], max_tokens=4096 * size)
    for pack in plan.packs:
        work, tokens = _balance([int(rows[g]) for g in pack], size, window)
        assert work < 1.02 and tokens < 1.01


@pytest.mark.parametrize("window", [None, 4096])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_balance_on_a_few_long_documents(size, window):
    rng = np.random.default_rng(1)
    for _ in range(20):
        count = int(rng.integers(1, 5))
        lengths = rng.multinomial(8192 * size - count, rng.dirichlet(np.ones(count))) + 1
        work, tokens = _balance(lengths.tolist(), size, window)
        assert work < 1.01 and tokens < 1.01
