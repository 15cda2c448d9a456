"""A run refused by any check leaves its --save_path as it found it (issue 23).

The CLI used to claim the folder (write ``run.json``, and under ``--overwrite`` delete the old run's
checkpoints and model) before the checks that only the data, the model or the cluster can answer; a run
refused there left its claim, and the next run said the folder "belonged to run ..., which left no
checkpoint or model". Each refusal below happened after that claim. The real ``train_sft`` CLI runs
in-process on the tiny model; no refusal starts Ray.
"""

import json
from pathlib import Path

import pytest

from openpack.cli import train_sft
from openpack.distributed.process import free_port

FLAGS = ["--train_batch_size", "2", "--max_steps", "1", "--max_len", "64", "--seed", "1"]


@pytest.fixture
def sft(tiny_pretrain, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def run(save_path, dataset, *flags, launcher="local") -> int:
        return train_sft.main(["--pretrain", tiny_pretrain, "--dataset", str(dataset), "--save_path", str(save_path),
                               *FLAGS, "--launcher", launcher, *flags])
    return run


@pytest.fixture
def bad_rows(tmp_path) -> Path:
    """A row with no 'prompt' key: refused when the data is tokenized (by the worker, or the Ray driver's planner)."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ab", "response": "ba"}) + "\n")
    return path


REFUSALS = {  # name -> (launcher, extra flags, the error's words); bad_rows is the dataset except for the cluster
    "a bad row, found by the worker (--launcher local)": ("local", [], "no key 'prompt'"),
    "a bad row, found by the Ray driver's planner": ("ray", [], "no key 'prompt'"),
    "no Ray cluster at --ray_address": ("ray", ["--ray_address", f"127.0.0.1:{free_port()}"], "no Ray cluster answers"),
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_run_leaves_no_claim_and_the_next_run_starts_without_a_notice(refusal, tmp_path, sft, sft_jsonl,
                                                                                 bad_rows, capsys):
    launcher, flags, words = REFUSALS[refusal]
    out = tmp_path / "run"
    dataset = sft_jsonl if "--ray_address" in flags else bad_rows
    assert sft(out, dataset, *flags, launcher=launcher) == 2
    assert words in capsys.readouterr().err
    assert not (out / "run.json").exists() and not (out / "run.lock").exists()

    assert sft(out, sft_jsonl) == 0
    assert "belonged to" not in capsys.readouterr().out
    assert (out / "run.json").exists() and (out / "model" / "config.json").exists()


def test_a_refused_overwrite_deletes_nothing(tmp_path, sft, sft_jsonl, bad_rows, capsys):
    """--overwrite deleted the old run's checkpoints and model at the claim, before the bad row was found."""
    assert sft(tmp_path, sft_jsonl, "--save_steps", "1") == 0
    before = (tmp_path / "run.json").read_text()
    assert sft(tmp_path, bad_rows, "--overwrite") == 2
    assert (tmp_path / "run.json").read_text() == before
    assert (tmp_path / "checkpoints" / "global_step1").is_dir() and (tmp_path / "model" / "config.json").exists()

    capsys.readouterr()
    assert sft(tmp_path, sft_jsonl, "--overwrite") == 0  # the claim, once every check passed, still overwrites
    assert "--overwrite: deleted the checkpoints (global_step1) and model of run" in capsys.readouterr().out
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] != json.loads(before)["run_id"]
