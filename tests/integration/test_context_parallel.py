"""A packed row split over 2 gloo processes equals the whole row: log-probs and summed gradients to 1e-5 (fp32).

Two processes (``context_parallel_script.py``) each run their part of the row through ``PackedCausalLM``, keys and
values all-gathered in every layer (``models.context_parallel``); log-probs and the two ranks' parameter gradients
are summed and compared with one unsplit forward and backward. Cases: Llama (4 query heads over 2 KV heads), Llama
with 8 over 2, Qwen2 with an 8-token window on one layer, Gemma-2 (attention and final logit softcaps, a window on
alternating layers), Llama with dynamic NTK rope (frequencies from each document's whole length). The guard case
splits the row as one document (attention over every gathered key before a token): it must fail.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openpack.core.context_parallel import split_row
from openpack.distributed.process import free_port

from context_parallel_script import CASES, LENGTHS

SCRIPT = Path(__file__).with_name("context_parallel_script.py")

EXACT = [name for name, case in CASES.items() if not case[3]]


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel") / "errors.json"
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), str(rank), "2", port, str(out)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


def test_the_row_has_the_hard_cases():
    """A document straddles the split, one is longer than a rank's share, one starts on the second rank."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    for window in (None, 8):
        shards = split_row(cu, 2, window)
        segments = [set(s.piece_segment.tolist()) for s in shards]
        assert segments[0] & segments[1]
        assert max(LENGTHS) > max(s.num_tokens for s in shards)
        starts_on_rank_1 = shards[1].piece_segment[shards[1].piece_offset == 0].tolist()
        assert starts_on_rank_1 and set(starts_on_rank_1) - segments[0]


@pytest.mark.parametrize("case", EXACT)
def test_split_row_equals_whole_row(errors, case):
    assert errors[case]["logprob_error"] < 1e-5, errors[case]
    assert errors[case]["grad_error"] < 1e-5, errors[case]


def test_ignoring_document_boundaries_fails(errors):
    """The guard: splitting the row as one document (a ring over the concatenated row) must not pass."""
    assert errors["llama_boundaries_ignored"]["logprob_error"] > 1e-2
    assert errors["llama_boundaries_ignored"]["grad_error"] > 1e-3
