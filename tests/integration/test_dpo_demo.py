"""`openpack train_dpo --packing_samples` with nothing else: the built-in DPO demo.

It trains (or reuses from the cache) the SFT demo model, then DPO on the
addition task's preference pairs; held-out preference accuracy and exact
match must both rise. About 2.5 minutes on 2 cores with an empty cache.
"""

import pytest

from openpack.cli import train_dpo

from conftest import read_metrics


@pytest.mark.slow
def test_dpo_demo_raises_both_accuracies(tmp_path, capsys):
    assert train_dpo.main(["--packing_samples", "--save_path", str(tmp_path)]) == 0
    assert "running the built-in demo" in capsys.readouterr().out
    evals = [m for m in read_metrics(tmp_path) if "eval_preference_accuracy" in m]
    before, after = evals
    assert before["eval_preference_accuracy"] == 0.5  # policy == reference: every implicit reward ties
    assert after["eval_preference_accuracy"] >= 0.75, after
    assert after["eval_exact_match"] >= before["eval_exact_match"] + 0.02, (before, after)
