"""The CPU cross call of context parallelism without a mask (``models.attention._PrefixThenCausal``).

A piece of a split document is Q queries, the last Q of its K keys, causal aligned to the bottom-right corner. On
CPU it runs as two flash calls (the P = K - Q earlier keys, unmasked; its own Q keys, causal) merged by their
log-sum-exps, instead of SDPA with an explicit [Q, K] mask that held ~13 bytes per element until the backward.
Here it is checked against that masked SDPA in float64, forward and backward, on the shapes a zigzag split makes
(the head piece Q == K, a tail piece Q << K, one query) with grouped KV heads, on strided views as ``_sdpa_cross``
passes them; and aligned top-left instead it must fail.
"""

import pytest
import torch
import torch.nn.functional as F

from openpack.models import attention


def _masked_reference(q, k, v, scale, top_left=False):
    queries, keys = q.shape[-2], k.shape[-2]
    mask = attention._bottom_right_mask(queries, keys, None, q.device)
    if top_left:
        mask = torch.ones(queries, keys, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _inputs(queries, keys, heads, kv_heads, seed=0):
    """Leaf tensors [T, H, D]; the tests view them as [1, H, T, D], strided as ``_sdpa_cross`` slices them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(keys, heads, 16, generator=gen, dtype=torch.float64)[keys - queries:]
    k, v = (torch.randn(keys, kv_heads, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize("queries, keys, heads, kv_heads", [(24, 24, 4, 2), (7, 40, 4, 2), (1, 9, 4, 4),
                                                            (33, 50, 8, 2)])
def test_equals_sdpa_with_the_bottom_right_mask(queries, keys, heads, kv_heads):
    leaves = _inputs(queries, keys, heads, kv_heads)
    q, k, v = (x[None].transpose(1, 2) for x in leaves)
    weights = torch.randn(1, heads, queries, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = _masked_reference(q, k, v, 0.3)
    want_grads = torch.autograd.grad((want * weights).sum(), leaves)
    leaves32 = [x.detach().float().requires_grad_() for x in leaves]
    got = attention._bottom_right_causal(*(x[None].transpose(1, 2) for x in leaves32), 0.3, heads // kv_heads)
    got_grads = torch.autograd.grad((got * weights.float()).sum(), leaves32)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_top_left_alignment_differs():
    """The guard: the same queries seeing keys from the top-left corner (what a plain causal call over a shorter
    query block computes) are not the piece's attention."""
    leaves = _inputs(7, 40, 4, 2)
    q, k, v = (x.detach().float()[None].transpose(1, 2) for x in leaves)
    got = attention._bottom_right_causal(q, k, v, None, 2)
    assert (got - _masked_reference(q, k, v, None, top_left=True)).abs().max() > 1e-2


def test_the_maskless_path_is_chosen_only_where_it_is_exact():
    q = torch.zeros(1, 4, 8, 16)
    assert attention._maskless_cross(q, 20, None, 0.0, None)
    assert attention._maskless_cross(q, 20, 20, 0.0, None)  # a window no shorter than the keys never cuts
    assert not attention._maskless_cross(q, 20, 8, 0.0, None)
    assert not attention._maskless_cross(q, 20, None, 0.1, None)
    assert not attention._maskless_cross(q, 20, None, 0.0, 50.0)
