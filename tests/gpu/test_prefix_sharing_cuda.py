"""Prefix sharing on CUDA in bf16: the two-pass kernels of ``models.attention`` per backend, against the block mask.

The CPU tests (tests/integration/test_prefix_sharing.py) check the layout in fp32, where the backend is SDPA;
here the fused kernels (torch's ``varlen_attn``, flash-attn if installed) run the cross pass (later responses
over prompt + self, bottom-right aligned), in bf16. Each bf16 result must stay within twice the error bf16
itself costs the unshared path, plus 1e-5 of the largest magnitude (``within_error_budget``); a misaligned
cross pass costs 1e-2 or more.

Run on a GPU machine: ``python -m pytest tests/gpu -q`` (``examples/gpu_runbook.py`` does).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from openpack.core.batch import collate_packed
from openpack.models.attention import _shared_prefix_attention, set_attention_backend
from openpack.models.tiny import TINY_ARCHS, tiny_causal_lm
from openpack.models.verify import random_groups, shared_prefix_mask, shared_vs_unpacked, within_error_budget

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (prompt length, completion lengths): an RL group of 4, a 1-token prompt and completion, a long completion that
# slides Mistral's 8-token window past the prompt, and a prompt with one completion (no cross pass for it).
GROUPS = [(12, [5, 9, 1, 7]), (1, [1, 3]), (6, [40, 2, 17]), (30, [11])]
BACKENDS = ["torch_varlen", "sdpa", "flash_attn"]


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    set_attention_backend("auto")


def skip_missing(backend):
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")


def shared_row():
    return collate_packed(random_groups(GROUPS, vocab_size=256)[0])


def masked_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_attention_in_bf16_equals_the_block_mask(backend, window):
    """Outputs and q/k/v gradients of the two-pass kernel in bf16 vs the block mask in fp32; the budget is what
    bf16 costs the same block-mask attention."""
    skip_missing(backend)
    batch = shared_row().to("cuda")
    assert batch.shared_prefix.cross_rows.numel() > 0
    generator = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch.num_tokens, 4, 64, generator=generator, device="cuda")  # 4 query heads over 2 KV heads
    k, v = (torch.randn(batch.num_tokens, 2, 64, generator=generator, device="cuda") for _ in range(2))
    weights = torch.randn(q.shape, generator=generator, device="cuda")
    mask = shared_prefix_mask(batch, window).cuda()

    def run(fn, dtype):
        inputs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*inputs)
        grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
        return [out.float(), *(g.float() for g in grads)]

    reference = run(lambda *x: masked_attention(*x, mask), torch.float32)
    dtype_cost = run(lambda *x: masked_attention(*x, mask), torch.bfloat16)
    shared = run(lambda *x: _shared_prefix_attention(backend, *x, batch.shared_prefix, None, 0.0, window, 2),
                 torch.bfloat16)
    for name, got, low, want in zip(("output", "dq", "dk", "dv"), shared, dtype_cost, reference):
        error, budget = (got - want).abs().max().item(), (low - want).abs().max().item()
        assert error <= 2 * budget + 1e-5 * max(1.0, want.abs().max().item()), (name, error, budget)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_shared_row_in_bf16_equals_each_completion_alone(arch, backend):
    """``check_packing``'s prefix-shared layout on a model: summed completion log-probs and gradients of one
    shared bf16 row against prompt + completion alone in fp32 (eager), budgeted by bf16's own error alone."""
    skip_missing(backend)
    set_attention_backend(backend)
    result = shared_vs_unpacked(tiny_causal_lm(arch, seed=1).cuda(), GROUPS, seed=1, dtype=torch.bfloat16)
    assert result["tokens"] < result["unshared_tokens"]
    assert within_error_budget(result), result
