"""`openpack train_dpo --packing_samples` with nothing else: the built-in DPO demo, through Ray (the default).

It trains (or reuses from the cache) the SFT demo model, then DPO on the
addition task's preference pairs; held-out preference accuracy and exact
match must both rise. About 2.5 minutes on 2 cores with an empty cache. The
command runs in a subprocess, as a user runs it, so its Ray cluster goes
with it.
"""

import os
import subprocess
import sys

import pytest

from conftest import read_metrics


@pytest.mark.slow
def test_dpo_demo_raises_both_accuracies(tmp_path):
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_dpo", "--packing_samples",
                             "--save_path", str(tmp_path)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "running the built-in demo" in result.stdout
    assert "ray: rank 0 pid" in result.stdout  # no --launcher: Ray
    evals = [m for m in read_metrics(tmp_path) if "eval_preference_accuracy" in m]
    before, after = evals
    assert before["eval_preference_accuracy"] == 0.5  # policy == reference: every implicit reward ties
    assert after["eval_preference_accuracy"] >= 0.75, after
    assert after["eval_exact_match"] >= before["eval_exact_match"] + 0.02, (before, after)
