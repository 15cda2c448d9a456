"""Collation outputs as literals: the two-sample example drawn in openpack/core/batch.py."""

import torch

from openpack.core.batch import CHOSEN, IGNORE_INDEX, REJECTED, SAMPLE, Segment, collate_packed

X = IGNORE_INDEX


def test_two_samples_literal():
    # sample 0: prompt 11 12 13, answer 14 15; sample 1: prompt 21 22, answer 23 24 25
    batch = collate_packed([
        Segment([11, 12, 13, 14, 15], [False, False, False, True, True], sample_index=0),
        Segment([21, 22, 23, 24, 25], [False, False, True, True, True], sample_index=1),
    ])
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24, 25]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    assert batch.labels.tolist() == [[X, X, 14, 15, X, X, 23, 24, 25, X]]
    assert batch.loss_mask.tolist() == [[False, False, True, True, False, False, True, True, True, False]]
    assert batch.segment_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 5, 10]
    assert batch.max_seqlen == 5
    assert batch.sample_index.tolist() == [0, 1] and batch.role.tolist() == [SAMPLE, SAMPLE]


def test_no_label_crosses_a_segment_boundary():
    """The last token of each segment predicts nothing, even when the next segment is all targets."""
    segments = [Segment([1, 2, 3], [True] * 3, 0, CHOSEN), Segment([4, 5], [True] * 2, 0, REJECTED)]
    batch = collate_packed(segments)
    ends = batch.cu_seqlens[1:] - 1
    assert (batch.labels[0, ends.long()] == X).all()
    assert batch.labels.tolist() == [[2, 3, X, 5, X]]
    assert batch.role.tolist() == [CHOSEN, REJECTED]


def test_first_token_is_never_a_target():
    batch = collate_packed([Segment([7, 8], [True, False], 3)])
    assert batch.labels.tolist() == [[X, X]] and not batch.loss_mask.any()


def test_attention_kwargs_carry_explicit_cu_seqlens():
    batch = collate_packed([Segment([1, 2], [True, True], 0), Segment([3], [True], 1)])
    kwargs = batch.attention_kwargs()
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 2, 3] and kwargs["max_length_q"] == 2


def test_moving_a_batch_finds_its_label_positions_on_the_host():
    """``to`` records where the labels are (found on the host: ``nonzero`` on a GPU would wait for its queue), for
    packed rows, padded rows and prefix-shared rows alike; the log-probs read there equal the ones found anew."""
    from openpack.core.batch import PROMPT, collate_padded
    from openpack.core.logprobs import token_logprobs

    segments = [Segment([5, 6, 7, 8], [False, False, True, True], 0), Segment([9, 10, 11], [False, True, True], 1)]
    shared = [Segment([5, 6], [False, False], 0, PROMPT), Segment([7, 8], [True, True], 0, CHOSEN, after_prompt=True),
              Segment([9], [True], 0, REJECTED, after_prompt=True)]
    for batch in (collate_packed(segments), collate_padded(segments), collate_packed(shared)):
        assert batch.label_positions is None
        moved = batch.to("cpu")
        flat = batch.labels.reshape(-1)
        assert moved.label_positions.tolist() == (flat != IGNORE_INDEX).nonzero()[:, 0].tolist()
        hidden, weight = torch.randn(flat.numel(), 4), torch.randn(12, 4)
        sources = getattr(batch, "label_source", None)
        torch.testing.assert_close(token_logprobs(hidden, weight, flat, sources=sources,
                                                  positions=moved.label_positions),
                                   token_logprobs(hidden, weight, flat, sources=sources))
