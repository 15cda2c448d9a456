"""Two VLLMEngine Ray actors behind one EngineGroup: sharded generation, weight sync, and a killed engine named; then
the first, which has --partial_rollout's concurrency group, taking weights while a generation of it waits paused.

One test (a Ray cluster and two vLLM engines cost 20-45 s on 2 cores); the script runs in its own process. The file
sorts after test_rollout_vllm.py on purpose: vLLM inspects a model class in a subprocess the first time it meets it
with an empty VLLM_CACHE_ROOT (~15 s here), and the test session's cache is shared by both files.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import HANG_S

pytestmark = pytest.mark.vllm
pytest.importorskip("ray")

SCRIPT = Path(__file__).with_name("rollout_vllm_ray_script.py")


@pytest.mark.slow
def test_engine_actors_generate_sync_and_report_a_dead_engine(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "model")], env=env,
                            capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["shape"] == [2, 2, 2, 2] and all(report["lengths"])
    assert report["changed"] > 1e-2  # both engines took the new weights: log-probs moved
    assert report["died"] is not None and report["died"].startswith("vLLM engine 1 of 2 on ")
    assert " pid " in report["died"] and "died" in report["died"]
    # --partial_rollout: a generation paused after 3 steps and resumed with pushed weights (rollout_vllm_ray_script)
    assert report["versions"] == [[None] * 3 + [1] * 5] * 4
