"""A packed forward equals one-by-one unpacked forwards, on tiny Llama, Qwen2 and Mistral.

The reference runs each segment alone through transformers' own eager
attention (no openpack code in the model path) and takes log_softmax of the
full logits. Segment lengths include 1 and lengths past Mistral's 8-token
sliding window.
"""

import pytest
import torch

from openpack.core.batch import Segment, collate_packed
from openpack.models.attention import ATTN_IMPLEMENTATION, PackedCacheError
from openpack.models.packed import packed_forward, packed_token_logprobs
from openpack.models.tiny import TINY_ARCHS, tiny_causal_lm
from openpack.models.verify import random_segments, reference_token_logprobs

LENGTHS = [7, 13, 1, 20, 5, 2]


@pytest.fixture(params=TINY_ARCHS)
def model(request):
    return tiny_causal_lm(request.param)


def test_packed_logprobs_equal_unpacked(model):
    segments = random_segments(LENGTHS, model.config.vocab_size, seed=1)
    packed = packed_token_logprobs(model, collate_packed(segments))
    reference = reference_token_logprobs(model, segments)
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=0)


def test_packed_gradients_equal_unpacked(model):
    segments = random_segments(LENGTHS, model.config.vocab_size, seed=2)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(0.5, 1.5, sum(LENGTHS))  # a weighted sum, so every position matters

    packed = packed_token_logprobs(model, collate_packed(segments))
    g_packed = torch.autograd.grad((packed * weights).sum(), params)
    reference = reference_token_logprobs(model, segments)
    g_ref = torch.autograd.grad((reference * weights).sum(), params)
    for (name, _), a, b in zip(model.named_parameters(), g_packed, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_segments_do_not_see_each_other(model):
    """Changing one segment's tokens leaves every other segment's log-probs bit-identical."""
    segments = random_segments([9, 9, 9], model.config.vocab_size, seed=3)
    before = packed_token_logprobs(model, collate_packed(segments))
    segments[1] = Segment([(t + 1) % model.config.vocab_size for t in segments[1].tokens], segments[1].targets, 1)
    after = packed_token_logprobs(model, collate_packed(segments))
    assert torch.equal(before[:9], after[:9]) and torch.equal(before[18:], after[18:])
    assert not torch.equal(before[9:18], after[9:18])


def test_transformers_isolation_breaks_with_a_cache():
    """Why the guard exists: transformers' own SDPA path, given packed position_ids, isolates
    segments without a cache and silently stops doing so with one."""
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    segments = random_segments([12, 16, 10], model.config.vocab_size, seed=4)
    batch = collate_packed(segments)
    reference = reference_token_logprobs(model, segments)

    def sdpa_logprobs(use_cache):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=use_cache).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        picked = logp.gather(1, batch.labels[0].clamp(min=0)[:, None])[:, 0]
        return torch.where(batch.loss_mask[0], picked, torch.zeros_like(picked))

    assert (sdpa_logprobs(use_cache=False) - reference).abs().max() < 1e-5
    assert (sdpa_logprobs(use_cache=True) - reference).abs().max() > 1e-2


def test_packed_forward_refuses_a_cache():
    model = tiny_causal_lm("llama")
    batch = collate_packed(random_segments([4, 5], model.config.vocab_size, seed=5))
    with pytest.raises(PackedCacheError, match="use_cache=False"):
        packed_forward(model, batch, use_cache=True)
    with pytest.raises(PackedCacheError, match="use_cache=False"):  # the attention function itself refuses too
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True, **batch.attention_kwargs())


def test_packed_rows_without_cu_seqlens_are_refused():
    model = tiny_causal_lm("qwen2")
    batch = collate_packed(random_segments([4, 5], model.config.vocab_size, seed=6))
    with pytest.raises(ValueError, match="never guesses packed boundaries"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)


def test_model_with_another_attention_is_refused():
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    batch = collate_packed(random_segments([3], model.config.vocab_size, seed=7))
    with pytest.raises(ValueError, match=ATTN_IMPLEMENTATION):
        packed_forward(model, batch)


def test_same_model_still_generates_unpacked():
    """Without cu_seqlens the attention is plain SDPA: generation with a cache matches eager."""
    model = tiny_causal_lm("mistral")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])  # longer than the 8-token window
    ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("eager")
    eager = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, eager)
