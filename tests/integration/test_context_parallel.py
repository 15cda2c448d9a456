"""A packed row split over 2 gloo processes equals the whole row: log-probs and summed gradients to 1e-5 (fp32).

Two processes (``context_parallel_script.py``) each run their part of the row through ``PackedCausalLM``, keys and
values all-gathered in every layer (``models.context_parallel``); log-probs and the two ranks' parameter gradients
are summed and compared with one unsplit forward and backward. Cases: Llama (4 query heads over 2 KV heads), Llama
with 8 over 2, Qwen2 with an 8-token window on one layer, Gemma-2 (attention and final logit softcaps, a window on
alternating layers), Llama with dynamic NTK rope (frequencies from each document's whole length). The guard case
splits the row as one document (attention over every gathered key before a token): it must fail.

Then the first command end to end: ``openpack train_sft --ring_attn_size 2`` on 2 ranks equals one rank (slow:
about 3 minutes each on a busy 2-core machine), and what it cannot split is refused up front.
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


def _sft(save_path, pretrain, dataset, *flags):
    from openpack.cli import train_sft
    assert train_sft.main(["--pretrain", pretrain, "--dataset", dataset, "--save_path", str(save_path),
                           *SFT_COMMON, *flags]) == 0
    return save_path


# test_train_sft.py's two steps of 8 samples, packed into rows of up to 128 tokens per rank
SFT_COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
              "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100", "--launcher",
              "local", "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128"]


@pytest.fixture(scope="module")
def one_rank_sft(tmp_path_factory, tiny_pretrain, sft_jsonl):
    """One rank, rows of up to 128 tokens (ZeRO-2 and ZeRO-3 train alike: tests/integration/test_zero_stages.py)."""
    return _sft(tmp_path_factory.mktemp("one_rank"), tiny_pretrain, sft_jsonl)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", ["2", "3"])
def test_train_sft_ring_of_two_equals_one_rank(tmp_path, one_rank_sft, tiny_pretrain, sft_jsonl, zero_stage):
    """``train_sft --ring_attn_size 2`` on 2 ranks (one context group, rows of up to 2 x 128 tokens) gives the
    losses, grad norms and weights of one rank with rows of 128: each rank's loss is its tokens' share of the
    step's sum, so DeepSpeed's mean over the world times the world size is the whole gradient, with ZeRO
    partitioning over both ranks and no data-parallel group of its own."""
    from hang_guard import HANG_S
    from saved_runs import assert_same_run, read_metrics

    ring = tmp_path / "ring"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl,
           "--save_path", str(ring), *SFT_COMMON, "--ring_attn_size", "2", "--zero_stage", zero_stage]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(ring, one_rank_sft)
    rows = [m["micro_batches"] for m in read_metrics(ring)]
    assert rows < [m["micro_batches"] for m in read_metrics(one_rank_sft)]  # rows hold more than 128 tokens


@pytest.mark.parametrize("flags, says", [
    (["--no_packing_samples", "--no_use_dynamic_batch"], "--ring_attn_size 2 needs --packing_samples"),
    ([], "a world size it divides (the run has 1 rank(s))"),  # --launcher local: one rank
])
def test_train_sft_refuses_what_it_cannot_split(flags, says, capsys):
    """Refused from the flags alone (the built-in demo's, which pack), in one line, before anything loads."""
    from openpack.cli import train_sft
    assert train_sft.main(["--save_path", "unused", "--launcher", "local", "--ring_attn_size", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["train_dpo", "train_rm", "train_ppo", "train_grpo"])
def test_other_commands_refuse_the_flag(command, capsys):
    """Only train_sft splits rows so far; the other commands have no such flag, and say so in one line."""
    import importlib
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"openpack.cli.{command}").main(["--ring_attn_size", "2"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --ring_attn_size 2" in capsys.readouterr().err
