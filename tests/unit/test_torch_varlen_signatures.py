"""The ``torch_varlen`` backend calls ``varlen_attn`` with whatever its installed signature takes.

``torch.nn.attention.varlen.varlen_attn`` runs on CUDA only, so each test puts
in its place a CPU stand-in with one shipped signature (torch 2.10, 2.11,
2.13), which computes causal attention per segment and is as strict as the
real one about what it is given. The adapter's output must equal the SDPA
backend's for grouped KV heads, a custom scale and a sliding window. The H200
run of 2026-11-26 (torch 2.11) failed every varlen forward with
``TypeError: varlen_attn() got an unexpected keyword argument 'enable_gqa'``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.attention.varlen as varlen_module

from openpack.models import attention


def _segments(q, k, v, cu_q, window_left, scale):
    """Causal attention per segment with equal heads: the stand-ins' arithmetic."""
    if q.shape[1] != k.shape[1]:
        raise RuntimeError(f"varlen_attn stand-in: {q.shape[1]} query heads vs {k.shape[1]} KV heads")
    return attention._sdpa_kernel(q, k, v, cu_q, None, scale, 0.0, window_left + 1 if window_left >= 0 else None, 1)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert is_causal
    return _segments(query, key, value, cu_seq_q, -1, None)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    assert window_size[1] == 0, "causal is (left, 0)"
    return _segments(query, key, value, cu_seq_q, window_size[0], scale)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert window_size[1] == 0, "causal is (left, 0)"
    if enable_gqa and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        return attention._sdpa_kernel(query, key, value, cu_seq_q, None, scale, 0.0,
                                      window_size[0] + 1 if window_size[0] >= 0 else None, groups)
    return _segments(query, key, value, cu_seq_q, window_size[0], scale)


@pytest.fixture
def stand_in(monkeypatch):
    def install(function):
        monkeypatch.setattr(varlen_module, "varlen_attn", function)
        attention._varlen_parameters.cache_clear()

    yield install
    attention._varlen_parameters.cache_clear()


def _inputs(query_heads, kv_heads, head_dim=32, lengths=(5, 9, 2)):
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=generator)
               for heads in (query_heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("function", [varlen_2_10, varlen_2_11, varlen_2_13], ids=["2.10", "2.11", "2.13"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("scale", [None, 0.05], ids=["default_scale", "scale_0.05"])
def test_each_signature_equals_sdpa(stand_in, function, kv_heads, scale):
    stand_in(function)
    q, k, v, cu, longest = _inputs(4, kv_heads)
    groups = 4 // kv_heads
    got = attention._torch_varlen_kernel(q, k, v, cu, longest, scale, 0.0, None, groups)
    want = attention._sdpa_kernel(q, k, v, cu, longest, scale, 0.0, None, groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("function", [varlen_2_11, varlen_2_13], ids=["2.11", "2.13"])
def test_sliding_window(stand_in, function):
    stand_in(function)
    q, k, v, cu, longest = _inputs(4, 2)
    got = attention._torch_varlen_kernel(q, k, v, cu, longest, None, 0.0, 3, 2)
    want = attention._sdpa_kernel(q, k, v, cu, longest, None, 0.0, 3, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_window_without_window_size_is_refused(stand_in):
    stand_in(varlen_2_10)
    q, k, v, cu, longest = _inputs(4, 4)
    with pytest.raises(ValueError, match="no sliding window"):
        attention._torch_varlen_kernel(q, k, v, cu, longest, None, 0.0, 3, 1)
