"""benchmarks/memory_real_model.py --smoke runs openpack (Ray) and TRL and reports the largest process, the sum and
the phases of the rank (about a minute on 2 cores: Ray's start-up and the two processes' imports)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import HANG_S

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_real_model.py"


@pytest.mark.slow
def test_memory_real_model_smoke(tmp_path):
    doc = tmp_path / "benchmarks.md"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--commands", "sft", "--out", str(tmp_path / "work"),
           "--markdown", str(doc)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sft,) = json.loads((tmp_path / "work" / "results.json").read_text())["results"]
    ours, theirs = sft["openpack"], sft["TRL"]
    assert ours["largest_name"].startswith("ray::_Rank")  # the rank, not the driver, is the largest process
    assert ours["sum_mb"] > ours["largest_mb"] > 0 and theirs["largest_mb"] > 0 and ours["processes"] > 3
    phases = [p["phase"] for p in ours["phases"]]
    assert phases[:2] == ["before loading --pretrain", "--pretrain loaded"] and phases[-1] == "final model save"
    assert "step 1 optimizer step" in phases
    assert sft["openpack_tokens_per_micro_batch"] == sft["trl_tokens_per_micro_batch"]
    assert "<!-- memory_real_model:begin -->" in doc.read_text()
