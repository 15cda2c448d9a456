"""`openpack train_sft` with no arguments: the built-in demo learns addition from scratch (~75 s on 2 cores)."""

import pytest

from openpack.cli import train_sft

from conftest import read_metrics


@pytest.mark.slow
def test_demo_accuracy_rises(tmp_path, capsys):
    assert train_sft.main(["--save_path", str(tmp_path), "--launcher", "local"]) == 0
    out = capsys.readouterr().out
    assert "running the built-in demo" in out and "held-out exact match after training" in out
    evals = [m["eval_exact_match"] for m in read_metrics(tmp_path) if "eval_exact_match" in m]
    assert len(evals) == 2
    before, after = evals
    assert before <= 0.05 and after >= 0.6, (before, after)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert (tmp_path / "loss.png").exists() and (tmp_path / "config.yaml").exists()
