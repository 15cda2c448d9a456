"""Chunked log-probs and their gradients equal the full-logits computation."""

import pytest
import torch

from openpack.core.batch import IGNORE_INDEX, Segment, collate_packed
from openpack.core.logprobs import segment_logprobs, token_logprobs


def full_logits_logprobs(hidden, weight, labels):
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    valid = labels != IGNORE_INDEX
    picked = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid, picked, torch.zeros_like(picked))


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 64])
def test_chunked_equals_full_logits_with_gradients(chunk_tokens):
    torch.manual_seed(0)
    T, H, V = 23, 16, 50
    hidden = torch.randn(T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    labels[[0, 5, 6, 22]] = IGNORE_INDEX
    upstream = torch.randn(T)  # a non-uniform loss weight per token

    ours = token_logprobs(hidden, weight, labels, chunk_tokens)
    ref = full_logits_logprobs(hidden, weight, labels)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert (ours[labels == IGNORE_INDEX] == 0).all()

    g_ours = torch.autograd.grad((ours * upstream).sum(), (hidden, weight))
    g_ref = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_ignored_positions_get_no_gradient():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8)
    labels = torch.tensor([IGNORE_INDEX, 3, IGNORE_INDEX, 1])
    token_logprobs(hidden, weight, labels, 2).sum().backward()
    assert hidden.grad[0].abs().sum() == 0 and hidden.grad[2].abs().sum() == 0
    assert hidden.grad[1].abs().sum() > 0


def test_segment_sums_means_and_counts():
    batch = collate_packed([Segment([1, 2, 3], [False, True, True], 0), Segment([4, 5], [False, True], 1)])
    per_token = torch.tensor([0.5, 0.25, 0.0, 2.0, 0.0])  # labels at positions 0, 1 and 3
    seg = segment_logprobs(batch, per_token)
    assert seg.sum.tolist() == [0.75, 2.0]
    assert seg.count.tolist() == [2, 1]
    assert seg.mean.tolist() == [0.375, 2.0]


def test_pairs_are_matched_by_sample_and_role_not_position():
    from openpack.core.batch import CHOSEN, REJECTED
    from openpack.core.logprobs import pair_segments

    # rows out of order: rejected of sample 7, chosen of 3, chosen of 7, rejected of 3
    batch = collate_packed([
        Segment([1, 2], [True, True], 7, REJECTED), Segment([1, 2], [True, True], 3, CHOSEN),
        Segment([1, 2], [True, True], 7, CHOSEN), Segment([1, 2], [True, True], 3, REJECTED),
    ])
    ids, chosen, rejected = pair_segments(batch)
    assert ids.tolist() == [3, 7] and chosen.tolist() == [1, 2] and rejected.tolist() == [3, 0]


def test_a_pair_split_across_micro_batches_is_refused():
    from openpack.core.batch import CHOSEN
    from openpack.core.logprobs import pair_segments

    batch = collate_packed([Segment([1, 2], [True, True], 0, CHOSEN)])
    with pytest.raises(ValueError, match="split across micro-batches"):
        pair_segments(batch)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_entropy_carries_its_gradient(softcap):
    """An entropy bonus trains on H_t: the chunked d H / d (hidden, head) == autograd through full (capped) logits,
    together with the log-probs' gradient; chunks of 3 rows over 7, two ignored."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    labels = torch.tensor([3, IGNORE_INDEX, 7, 1, 49, IGNORE_INDEX, 0])
    a, b = torch.randn(7), torch.randn(7)
    entropy = torch.empty(7)
    logp = token_logprobs(hidden, weight, labels, chunk_tokens=3, entropy=entropy, softcap=softcap)
    chunked = torch.autograd.grad((a * logp + b * entropy).sum(), (hidden, weight))
    logits = hidden @ weight.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    full = torch.log_softmax(logits, -1)
    kept = labels != IGNORE_INDEX
    expected_logp = torch.where(kept, full.gather(1, labels.clamp(min=0)[:, None])[:, 0], torch.zeros(7))
    expected_entropy = torch.where(kept, -(full.exp() * full).sum(-1), torch.zeros(7))
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-6)
    expected = torch.autograd.grad((a * expected_logp + b * expected_entropy).sum(), (hidden, weight))
    for ours, theirs in zip(chunked, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
