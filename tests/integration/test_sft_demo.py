"""`openpack train_sft` with no arguments: the built-in demo learns addition from scratch (~40 s on 2 cores)."""

import pytest

from openpack.cli import train_sft

from saved_runs import read_metrics


@pytest.mark.slow
def test_demo_accuracy_rises(tmp_path, capsys):
    assert train_sft.main(["--save_path", str(tmp_path), "--launcher", "local"]) == 0
    out = capsys.readouterr().out
    assert "running the built-in demo" in out and "held-out after training: right answers" in out
    before, after = [m for m in read_metrics(tmp_path) if "eval_exact_match" in m]
    # seeds 42, 1, 2 (docs/sft.md, 2026-11-25): 98.2%, 99.0%, 89.6% right; 0.6%, 0.9%, 0.0% bare
    assert before["eval_exact_match"] <= 0.05 and after["eval_exact_match"] >= 0.9, (before, after)
    # 7 in 10 training answers are wordy ("it is 42"): greedy decoding answers wordily, which DPO's demo then changes
    assert after["eval_bare_answer"] <= 0.05, after
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert (tmp_path / "loss.png").exists() and (tmp_path / "config.yaml").exists()
