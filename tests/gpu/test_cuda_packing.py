"""Packed == unpacked on CUDA, per backend and dtype. Skipped without a GPU; never faked.

Run on a GPU machine: ``python -m pytest tests/gpu -q``; record the outcome,
the device name and the date in docs/verification.md.
"""

import importlib.util

import pytest
import torch

from openpack.models.attention import set_attention_backend
from openpack.models.tiny import TINY_ARCHS, tiny_causal_lm
from openpack.models.verify import packed_vs_unpacked, within_error_budget

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTHS = [7, 13, 1, 20, 5, 2, 64, 31, 257]
CASES = [
    ("torch_varlen", torch.bfloat16),
    ("torch_varlen", torch.float16),
    ("torch_varlen", torch.float32),
    ("sdpa", torch.float32),
    ("sdpa", torch.bfloat16),
    ("flash_attn", torch.bfloat16),
]


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    set_attention_backend("auto")


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("backend,dtype", CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
def test_packed_equals_unpacked_on_cuda(arch, backend, dtype):
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    set_attention_backend(backend)
    model = tiny_causal_lm(arch).cuda()
    try:
        result = packed_vs_unpacked(model, LENGTHS, dtype=dtype)
    except RuntimeError as err:
        if backend == "torch_varlen" and dtype == torch.float32:
            pytest.xfail(f"torch varlen_attn rejects fp32 (auto uses sdpa for fp32): {err}")
        raise
    assert within_error_budget(result), result
