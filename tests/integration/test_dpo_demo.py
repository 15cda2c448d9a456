"""`openpack train_dpo --packing_samples` with nothing else: the built-in DPO demo, through Ray (the default).

It trains (or reuses from the cache) the SFT demo model, whose answers are right but mostly wordy ("it is
42", as 7 in 10 SFT answers are), then DPO on pairs that always prefer the bare right answer. Measured with
`openpack train_dpo --packing_samples --seed S` for S = 42, 1, 2 on a fresh cache (2 CPU cores,
2026-11-25; docs/dpo.md):

    seed  right answers (either form)  bare right answers  preference accuracy
    42    98.2% -> 99.0%               0.6% -> 99.0%       50% -> 95.9%
    1     99.0% -> 99.0%               0.9% -> 99.0%       50% -> 94.8%
    2     89.6% -> 92.7%               0.0% -> 92.7%       50% -> 90.6%

The assertions are what held for seeds 42 and 1, with a margin (seed 2's SFT model is right on only 89.6%). The
command runs in a subprocess, as a user runs it, so its Ray cluster goes with it. The cache folder is this test
session's fresh one: the SFT demo model is trained here, or was trained by this same code (its cache folder is
named by a digest of the code).

In `.ci/run` the README's quick start has just run this very command on a fresh clone; the run checked is that
one (``OPENPACK_QUICK_START_DPO``: its console output, saved by `.ci/run`), not a second run of it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import HANG_S
from saved_runs import read_metrics


def demo_run(tmp_path) -> tuple[str, Path]:
    """The console output and the run folder of `openpack train_dpo --packing_samples`: the quick start's in
    `.ci/run` (it exited 0, or CI stopped there), else a run made here."""
    quick_start = os.environ.get("OPENPACK_QUICK_START_DPO")
    if quick_start:
        out = Path(quick_start).read_text()
        saved = re.findall(r"^model saved to (.+)/model$", out, re.M)
        assert saved, out[-3000:]
        return out, Path(saved[-1])
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_dpo", "--packing_samples",
                             "--save_path", str(tmp_path)], capture_output=True, text=True, timeout=HANG_S,
                            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, tmp_path


@pytest.mark.slow
def test_dpo_demo_teaches_the_preferred_answer_form(tmp_path):
    out, run = demo_run(tmp_path)
    assert "running the built-in demo" in out
    assert "held-out after training: preference accuracy" in out  # the demo says what it did
    assert "ray: rank 0 pid" in out  # no --launcher: Ray
    before, after = [m for m in read_metrics(run) if "eval_preference_accuracy" in m]
    assert before["eval_preference_accuracy"] == 0.5  # policy == reference: every implicit reward ties
    assert after["eval_preference_accuracy"] >= 0.9, after
    assert before["eval_exact_match"] >= 0.9 and before["eval_bare_answer"] <= 0.05, before  # SFT: right, wordy
    assert after["eval_bare_answer"] >= 0.95, after  # DPO: the preferred form
    assert after["eval_exact_match"] >= before["eval_exact_match"] - 0.01, (before, after)  # and still right
