"""Gemma-2/3 softcapping under packing: the final-logit cap in the chunked and fused heads, the attention-logit cap
in every attention path, each equal to transformers' own eager computation.

Both caps are ``cap * tanh(x / cap)``. The models are built with ``initializer_range=0.2`` so their logits and
attention scores are large enough for the caps to change log-probs by more than 0.1
(``test_the_softcaps_matter``), which makes the equivalence tests fail if either cap is dropped. Gemma-3 in
transformers 5.19 never passes ``attn_logit_softcapping`` to its attention (QK-norm replaced it), so there only the
final cap applies, in eager and in openpack alike.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from openpack.core.batch import IGNORE_INDEX, collate_packed, collate_padded
from openpack.core.fused_loss import FusedLoss, fused_segment_loss
from openpack.core.logprobs import pair_segments, segment_logprobs, token_logprobs
from openpack.data.preference import PreferencePair
from openpack.models import attention
from openpack.models.packed import fused_batch_loss, packed_token_logprobs, padded_token_logprobs
from openpack.models.verify import (attention_implementation, packed_vs_unpacked, random_segments,
                                    reference_token_logprobs, within_error_budget)

LENGTHS = [7, 13, 1, 20, 5, 2, 13]  # two of 13: a length group of two segments; 13 and 20 > the 8-token window
SMALL = dict(final_logit_softcapping=2.0, attn_logit_softcapping=1.0)  # tanh saturates
GEMMA = dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)  # Gemma-2's released values
NONE = dict(final_logit_softcapping=None, attn_logit_softcapping=None)


def tiny_gemma(arch: str, **caps):
    """A 2-layer Gemma-2 or Gemma-3 (one sliding layer of 8 tokens, one global), fp32, openpack's attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                  max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.2,
                  layer_types=["sliding_attention", "full_attention"], **caps)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **fields),
                                             attn_implementation=attention.register_packed_attention(),
                                             dtype=torch.float32)
    return model.eval()


def capped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(logits / cap)


# --- the chunked and fused heads --------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_token_logprobs_and_entropy_with_softcap_equal_autograd(chunk_tokens):
    torch.manual_seed(0)
    T, H, V, cap = 23, 16, 50, 2.0
    hidden = (3 * torch.randn(T, H)).requires_grad_()  # logits of ~12: deep in tanh's saturation
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    labels[[0, 5, 6, 22]] = IGNORE_INDEX
    upstream = torch.randn(T)
    entropy = torch.empty(T)

    ours = token_logprobs(hidden, weight, labels, chunk_tokens, entropy, softcap=cap)
    logp = torch.log_softmax(capped(hidden @ weight.T, cap), dim=-1)
    valid = labels != IGNORE_INDEX
    ref = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    ref_entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=0)
    for a, b in zip(torch.autograd.grad((ours * upstream).sum(), (hidden, weight)),
                    torch.autograd.grad((ref * upstream).sum(), (hidden, weight))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plain = token_logprobs(hidden, weight, labels, chunk_tokens)
    assert (plain - ours).abs().max() > 1.0  # the cap changes the answer


def _pair_loss(sums: torch.Tensor) -> torch.Tensor:
    """A DPO-like loss, nonlinear in each pair's two sums (segments 2k and 2k + 1)."""
    return -torch.nn.functional.logsigmoid(0.3 * (sums[0::2] - sums[1::2])).sum() / 4


@pytest.mark.parametrize("chunk_tokens", [1, 5, 1000])
@pytest.mark.parametrize("loss_name", ["pair", "sft"])
def test_fused_loss_with_softcap_equals_autograd(loss_name, chunk_tokens):
    """8 segments of 5 tokens, the first of each unlabelled; the reference is plain autograd through capped logits."""
    gen = torch.Generator().manual_seed(0)
    T, H, V, cap = 40, 8, 50, 2.0
    hidden = 3 * torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[::5] = IGNORE_INDEX
    segment_ids = torch.arange(T) // 5
    loss_of_sums, groups = (_pair_loss, segment_ids // 2) if loss_name == "pair" else (lambda s: -s.sum() / 32, None)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = torch.log_softmax(capped(h @ w.T, cap), dim=-1)
    per_token = torch.where(labels != IGNORE_INDEX, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    want_sums = torch.zeros(8).index_add(0, segment_ids, per_token)
    want_loss = loss_of_sums(want_sums)
    want_grads = torch.autograd.grad(want_loss, (h, w))

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, sums = fused_segment_loss(h, w, segment_ids, labels, 8, FusedLoss(loss_of_sums, labels, groups),
                                    chunk_tokens, softcap=cap)
    got_grads = torch.autograd.grad(2.0 * loss, (h, w))  # the incoming gradient scales both
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums, want_sums.detach(), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("hidden", "weight"), got_grads, want_grads):
        torch.testing.assert_close(got / 2, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")


# --- whole models: packed == each segment alone through transformers' eager attention ---------------------------

@pytest.mark.parametrize("caps", [NONE, GEMMA, SMALL], ids=["no_caps", "gemma_caps", "small_caps"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_packed_equals_unpacked(arch, caps):
    result = packed_vs_unpacked(tiny_gemma(arch, **caps), LENGTHS)
    assert within_error_budget(result), result


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_the_softcaps_matter(arch):
    """Dropping either cap moves the reference log-probs by > 0.1, so the tests above would see it dropped."""
    model = tiny_gemma(arch, **SMALL)
    segments = random_segments(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        reference = reference_token_logprobs(model, segments)
        model.config.final_logit_softcapping = None
        without_final = reference_token_logprobs(model, segments)
        model.config.final_logit_softcapping = SMALL["final_logit_softcapping"]
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        without_attention = reference_token_logprobs(model, segments)
    assert (reference - without_final).abs().max() > 0.1
    attention_effect = (reference - without_attention).abs().max()
    assert attention_effect > 0.1 if arch == "gemma2" else attention_effect == 0  # Gemma-3 never passes it


def test_padded_batch_and_generation_apply_the_attention_softcap():
    """The unpacked path (no cu_seq_lens_q): padded rows equal the packed row; a forward and a cached decoding step
    equal transformers' eager attention (transformers' SDPA would drop the softcap)."""
    model = tiny_gemma("gemma2", **SMALL)
    segments = random_segments(LENGTHS, model.config.vocab_size, seed=1)
    packed_batch, padded_batch = collate_packed(segments), collate_padded(segments)
    with torch.no_grad():
        packed = packed_token_logprobs(model, packed_batch)[packed_batch.loss_mask[0]]
        padded = padded_token_logprobs(model, padded_batch)[padded_batch.loss_mask.reshape(-1)]
    torch.testing.assert_close(padded, packed, atol=1e-5, rtol=0)

    ids = torch.tensor([segments[3].tokens])  # 20 tokens > the 8-token window
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits[0]
        cache = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        step = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]
        with attention_implementation(model, "eager"):
            eager = model(input_ids=ids, use_cache=False).logits[0]
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
    torch.testing.assert_close(step, eager[-1], atol=1e-5, rtol=0)


def test_fused_batch_loss_equals_the_reference():
    """``--fused_loss`` on the model: its segment sums and gradients equal the eager reference's (SFT's NLL)."""
    model = tiny_gemma("gemma2", **SMALL)
    segments = random_segments(LENGTHS, model.config.vocab_size, seed=3)
    batch = collate_packed(segments)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_of_sums = lambda sums: -sums.sum() / 10  # noqa: E731
    loss, sums = fused_batch_loss(model, batch, FusedLoss(loss_of_sums, batch.labels.reshape(-1)))
    got = torch.autograd.grad(loss, params)
    want_sums = segment_logprobs(batch, reference_token_logprobs(model, segments)).sum
    want = torch.autograd.grad(loss_of_sums(want_sums), params)
    torch.testing.assert_close(sums, want_sums.detach(), atol=1e-5, rtol=0)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_prefix_sharing_equals_unshared():
    """Prompt | chosen | rejected: the rejected pass (``_sdpa_cross``) caps its scores too."""
    model = tiny_gemma("gemma2", **SMALL)
    gen = torch.Generator().manual_seed(2)

    def draw(n):
        return torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()

    pairs = [PreferencePair(draw(p), draw(c), draw(r), "t") for p, c, r in [(5, 7, 9), (12, 10, 6), (9, 1, 14)]]
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.tensor([0.5, 1.0, 1.5])  # a weighted margin, so every pair's gradient counts
    results = []
    for shared in (False, True):
        batch = collate_packed([s for i, pair in enumerate(pairs)
                                for s in (pair.shared_segments(i) if shared else pair.segments(i))])
        logprobs = packed_token_logprobs(model, batch)
        _, chosen, rejected = pair_segments(batch)
        sums = segment_logprobs(batch, logprobs).sum
        grads = torch.autograd.grad((weights * sums[chosen] - weights.flip(0) * sums[rejected]).sum(), params)
        results.append((logprobs[batch.loss_mask[0]].detach(), grads))
    (unshared, unshared_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, unshared, atol=1e-5, rtol=0)
    for (name, _), a, b in zip(model.named_parameters(), shared_grads, unshared_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# --- the CUDA backends' plumbing, with CPU stand-ins ---------------------------------------------------------------

def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn 2.6's signature (softcap 0.0: off), computed by the SDPA backend."""
    assert causal and window_size[1] in (0, -1)
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    return attention._sdpa_cross(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, dropout_p, window,
                                 q.shape[1] // k.shape[1], softcap or None)


@pytest.fixture
def flash_attn_stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: True)
    attention.set_attention_backend("flash_attn")
    yield
    attention.set_attention_backend("auto")


def test_flash_attn_backend_gets_the_softcap(flash_attn_stand_in):
    result = packed_vs_unpacked(tiny_gemma("gemma2", **SMALL), LENGTHS)
    assert within_error_budget(result), result


def test_torch_varlen_refuses_a_softcap_and_auto_avoids_it(monkeypatch):
    q, k, v = (torch.randn(6, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="--attn_backend flash_attn .* or --attn_backend sdpa"):
        attention._torch_varlen_kernel(q, k, v, cu, 6, None, 0.0, None, 1, softcap=1.0)
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)
    monkeypatch.setattr(attention, "_torch_varlen_available", lambda: True)
    cuda = torch.device("cuda")
    assert attention.resolve_backend(cuda, torch.bfloat16) == "torch_varlen"
    assert attention.resolve_backend(cuda, torch.bfloat16, softcap=True) == "sdpa"


def test_other_logit_transforms_are_still_refused():
    model = tiny_gemma("gemma2", **SMALL)
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="config.logit_scale"):
        packed_token_logprobs(model, collate_packed(random_segments([4], model.config.vocab_size)))
