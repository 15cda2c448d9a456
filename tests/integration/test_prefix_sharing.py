"""--prefix_sharing equals the unshared packed path on tiny Llama, Qwen2 and Mistral, in fp32 on CPU.

A pair laid out prompt | chosen | rejected (the prompt computed once) must give the same chosen and rejected
log-probs, gradients and reward-model rewards as prompt + chosen and prompt + rejected packed as two
segments. Mistral's sliding window (8 tokens) is shorter than most prompt + response lengths here, so it must
apply in position space for the rejected tokens, whose rows sit after chosen's. The attention itself is
checked against the block-mask reference (``models.verify.shared_prefix_mask``) with smaller windows too.
"""

import pytest
import torch
import torch.nn.functional as F

from openpack.core.batch import CHOSEN, PROMPT, Segment, collate_packed
from openpack.core.logprobs import pair_segments, segment_logprobs
from openpack.data.preference import PreferencePair
from openpack.models.attention import _shared_prefix_attention, register_packed_attention
from openpack.models.packed import packed_token_logprobs
from openpack.models.reward import PackedRewardModel
from openpack.models.tiny import TINY_ARCHS, tiny_causal_lm, tiny_config
from openpack.models.verify import shared_prefix_mask

# (prompt, chosen, rejected) lengths: a 1-token prompt and response, and prompt + response up to 23 > window 8
LENGTHS = [(5, 7, 9), (1, 3, 1), (12, 10, 6), (9, 1, 14)]
EOS = 2


def random_pairs(vocab_size: int, seed: int, eos: bool = False) -> list[PreferencePair]:
    generator = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randint(3, vocab_size, (n,), generator=generator).tolist()

    tail = [EOS] if eos else []
    return [PreferencePair(draw(p), draw(c) + tail, draw(r) + tail, "test") for p, c, r in LENGTHS]


def layouts(pairs):
    """(unshared, shared) packed rows of the same pairs."""
    return (collate_packed([s for i, pair in enumerate(pairs) for s in pair.segments(i)]),
            collate_packed([s for i, pair in enumerate(pairs) for s in pair.shared_segments(i)]))


@pytest.fixture(params=TINY_ARCHS)
def model(request):
    return tiny_causal_lm(request.param)


@pytest.mark.parametrize("window", [None, 3, 8])
def test_attention_equals_the_block_mask_reference(window):
    _, batch = layouts(random_pairs(256, seed=0))
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, 4, 8, generator=generator)  # 4 query heads over 2 KV heads
    k, v = (torch.randn(batch.num_tokens, 2, 8, generator=generator) for _ in range(2))
    out = _shared_prefix_attention("sdpa", q, k, v, batch.shared_prefix, None, 0.0, window, 2)
    mask = shared_prefix_mask(batch, window)
    reference = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask,
                                               enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_groups_of_many_responses_equal_the_block_mask_reference(window):
    """Prompts with 5 responses each, most of one length (an RL group): the CPU kernel batches the later responses
    of equal (query, key) lengths into one call, and must still equal the block mask."""
    generator = torch.Generator().manual_seed(2)
    segments = []
    for sample, (prompt, responses) in enumerate([(6, [4, 4, 4, 2, 4]), (6, [4, 1, 4, 4, 4]), (3, [5, 5, 5, 5, 5])]):
        segments.append(Segment(torch.randint(3, 256, (prompt,), generator=generator).tolist(), [False] * prompt,
                                sample, PROMPT))
        for n in responses:
            segments.append(Segment(torch.randint(3, 256, (n,), generator=generator).tolist(), [True] * n, sample,
                                    CHOSEN, after_prompt=True))
    batch = collate_packed(segments)
    assert batch.shared_prefix.cross_cu_seqlens_q.numel() - 1 == 12  # every response but each prompt's first
    q = torch.randn(batch.num_tokens, 4, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(batch.num_tokens, 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    out = _shared_prefix_attention("sdpa", q, k, v, batch.shared_prefix, None, 0.0, window, 2)
    mask = shared_prefix_mask(batch, window)
    reference = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask,
                                               enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)
    weights = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    reference_grads = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_block_mask_reference_by_hand():
    """Prompt p0 p1 p2, chosen c0 c1, rejected r0 r1 r2 under a window of 3 positions."""
    _, batch = layouts([PreferencePair([10, 11, 12], [20, 21], [30, 31, 32], "x")])
    rows = shared_prefix_mask(batch, window=3).int().tolist()
    assert rows == [
        [1, 0, 0, 0, 0, 0, 0, 0],  # p0
        [1, 1, 0, 0, 0, 0, 0, 0],  # p1
        [1, 1, 1, 0, 0, 0, 0, 0],  # p2
        [0, 1, 1, 1, 0, 0, 0, 0],  # c0 (position 3): positions 1..3
        [0, 0, 1, 1, 1, 0, 0, 0],  # c1 (position 4): positions 2..4
        [0, 1, 1, 0, 0, 1, 0, 0],  # r0 (position 3): p1, p2 and itself, never chosen
        [0, 0, 1, 0, 0, 1, 1, 0],  # r1 (position 4)
        [0, 0, 0, 0, 0, 1, 1, 1],  # r2 (position 5): the prompt is out of the window
    ]


def pair_results(model, batch, weights):
    """Token log-probs (labelled, in order), chosen and rejected sums, and the gradient of a weighted margin."""
    params = [p for p in model.parameters() if p.requires_grad]
    logprobs = packed_token_logprobs(model, batch)
    _, chosen_at, rejected_at = pair_segments(batch)
    sums = segment_logprobs(batch, logprobs).sum
    chosen, rejected = sums[chosen_at], sums[rejected_at]
    grads = torch.autograd.grad((weights * chosen - weights.flip(0) * rejected).sum(), params)
    return logprobs[batch.loss_mask[0]].detach(), chosen.detach(), rejected.detach(), grads


def test_logprobs_and_gradients_equal_unshared(model):
    unshared, shared = layouts(random_pairs(model.config.vocab_size, seed=2))
    assert shared.num_tokens == unshared.num_tokens - sum(p for p, _, _ in LENGTHS)
    weights = torch.linspace(0.5, 1.5, len(LENGTHS))
    expected, got = pair_results(model, unshared, weights), pair_results(model, shared, weights)
    for name, a, b in zip(("token log-probs", "chosen", "rejected"), got[:3], expected[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    for (name, _), a, b in zip(model.named_parameters(), got[3], expected[3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_rejected_never_sees_chosen(model):
    pairs = random_pairs(model.config.vocab_size, seed=3)
    _, before = layouts(pairs)
    pairs[2].chosen = [(t + 1) % model.config.vocab_size for t in pairs[2].chosen]
    _, after = layouts(pairs)
    a, b = (packed_token_logprobs(model, batch) for batch in (before, after))
    changed = before.segment_ids == 7  # pair 2's chosen: segments prompt 6, chosen 7, rejected 8
    assert torch.equal(a[~changed], b[~changed]) and not torch.equal(a[changed], b[changed])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_rewards_equal_unshared(arch):
    """Rewards at each response's last token that is not pad (pad = eos here, as TRL's RewardTrainer reads);
    pair 1's chosen is eos alone, so both layouts read it at the prompt's last token."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = tiny_config(arch, num_labels=1, pad_token_id=EOS)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation=register_packed_attention())
    pairs = random_pairs(config.vocab_size, seed=4, eos=True)
    pairs[1].chosen = [EOS]
    rewards = PackedRewardModel(model.eval())
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for batch in layouts(pairs):
        _, chosen_at, rejected_at = pair_segments(batch)
        segment_rewards = rewards(batch)
        chosen, rejected = segment_rewards[chosen_at], segment_rewards[rejected_at]
        results.append((chosen, rejected, torch.autograd.grad((chosen - 2 * rejected).sum(), params)))
    (c0, r0, g0), (c1, r1, g1) = results
    torch.testing.assert_close(c1, c0, atol=1e-5, rtol=0)
    torch.testing.assert_close(r1, r0, atol=1e-5, rtol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
