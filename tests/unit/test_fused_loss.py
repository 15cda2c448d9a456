"""--fused_loss: the fused head + loss equals the chunked log-probs followed by the same loss, value and gradients."""

from __future__ import annotations

import pytest
import torch

from openpack.core.batch import IGNORE_INDEX
from openpack.core.fused_loss import FusedLoss, fused_segment_loss, plan_fused_chunks
from openpack.core.logprobs import token_logprobs
from hang_guard import HANG_S

T, H, V = 40, 8, 50


def _inputs(seed: int = 0):
    """One row of 8 segments of 5 tokens (4 pairs: segments 2k, 2k + 1), the first token of each unlabelled."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float32)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float32) / 3
    labels = torch.randint(0, V, (T,), generator=gen)
    segment_ids = torch.arange(T) // 5
    labels[::5] = IGNORE_INDEX
    return hidden, weight, labels, segment_ids


def _pair_loss(sums: torch.Tensor) -> torch.Tensor:
    """A DPO-like loss, nonlinear in each pair's two sums: -log sigmoid(0.3 (chosen - rejected))."""
    margin = sums[0::2] - sums[1::2]
    return -torch.nn.functional.logsigmoid(0.3 * margin).sum() / 4


def _sft_loss(sums: torch.Tensor) -> torch.Tensor:
    return -sums.sum() / 32


def _reference(hidden, weight, labels, segment_ids, loss_of_sums):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    per_token = token_logprobs(hidden, weight, labels, chunk_tokens=7)
    sums = torch.zeros(8, dtype=per_token.dtype).index_add(0, segment_ids, per_token)
    loss = loss_of_sums(sums)
    loss.backward()
    return loss.detach(), sums.detach(), hidden.grad, weight.grad


def _fused(hidden, weight, labels, segment_ids, loss_of_sums, groups, chunk_tokens):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, sums = fused_segment_loss(hidden, weight, segment_ids, labels, 8, FusedLoss(loss_of_sums, labels, groups),
                                    chunk_tokens)
    (2.0 * loss).backward()  # the incoming gradient scales both gradients
    return loss.detach(), sums, hidden.grad / 2, weight.grad / 2


@pytest.mark.parametrize("chunk_tokens", [1, 5, 9, 1000])
@pytest.mark.parametrize("loss_name", ["pair", "sft"])
def test_fused_equals_chunked_logprobs_then_loss(loss_name, chunk_tokens):
    hidden, weight, labels, segment_ids = _inputs()
    loss_of_sums, groups = (_pair_loss, segment_ids // 2) if loss_name == "pair" else (_sft_loss, None)
    want = _reference(hidden, weight, labels, segment_ids, loss_of_sums)
    got = _fused(hidden, weight, labels, segment_ids, loss_of_sums, groups, chunk_tokens)
    for name, a, b in zip(("loss", "sums", "grad hidden", "grad weight"), got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6, msg=name)


def test_chunks_hold_whole_groups_in_group_order():
    """Pairs 0 and 1 interleaved in the row still form contiguous, whole chunks; a pair is never cut."""
    labels = torch.tensor([IGNORE_INDEX, 1, 2, IGNORE_INDEX, 3, 4, 5, 6])
    groups = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    positions, chunks = plan_fused_chunks(labels, groups, chunk_tokens=2)
    assert positions.tolist() == [1, 4, 5, 2, 6, 7]
    assert chunks == [(0, 3), (3, 6)]  # each pair (3 labels) is over the budget of 2: one chunk each
    positions, chunks = plan_fused_chunks(labels, groups, chunk_tokens=6)
    assert chunks == [(0, 6)]
    _, chunks = plan_fused_chunks(labels, None, chunk_tokens=4)
    assert chunks == [(0, 4), (4, 6)]


def test_a_chunk_that_cuts_a_pair_gives_a_wrong_gradient():
    """Why chunks hold whole groups: cut a pair (no groups given) and its first half sees a partial sum."""
    hidden, weight, labels, segment_ids = _inputs()
    want = _reference(hidden, weight, labels, segment_ids, _pair_loss)
    got = _fused(hidden, weight, labels, segment_ids, _pair_loss, None, chunk_tokens=3)
    torch.testing.assert_close(got[0], want[0].to(got[0].dtype))  # the loss itself is taken from the final sums
    assert (got[2] - want[2]).abs().max() > 1e-3


def test_frozen_head_gets_no_gradient():
    """LoRA freezes the head: no [V, H] gradient is built, and the hidden states' gradient is unchanged."""
    hidden, weight, labels, segment_ids = _inputs()
    want = _reference(hidden, weight, labels, segment_ids, _pair_loss)
    hidden = hidden.clone().requires_grad_()
    loss, _ = fused_segment_loss(hidden, weight, segment_ids, labels, 8, FusedLoss(_pair_loss, labels, segment_ids // 2), 9)
    loss.backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, want[2])


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    """benchmarks/fused_loss.py --smoke: both parts run, the arms agree, and the docs section is written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    doc = tmp_path / "benchmarks.md"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_loss.py"
    cmd = [sys.executable, str(script), "--smoke", "--out", str(tmp_path / "work"), "--markdown", str(doc)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "work" / "results.json").read_text())["summary"]
    assert summary["max_loss_diff"] < 1e-4 and summary["max_grad_diff"] < 1e-4
    assert len(summary["head"]) == 1 and summary["time_ratio"][0] > 0
    assert "<!-- fused_loss:begin -->" in doc.read_text()
