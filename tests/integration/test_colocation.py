"""--colocate_all_models: the order of a colocated turn, fresh weights after a wake, and a colocated run.

On CPU vLLM's sleep is a no-op and the run skips DeepSpeed's offload, so what these tests can show is the
sequence (with the real objects underneath, recorded) and that vLLM scores with the trainer's current weights
after a wake. That sleep frees GPU memory is vLLM's and DeepSpeed's business and needs a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from saved_runs import read_metrics

SCRIPT = Path(__file__).with_name("colocation_script.py")
TURN = ["deepspeed.offload_states", "deepspeed.reload_states"]


@pytest.mark.slow
def test_a_turn_wakes_pushes_offloads_generates_sleeps_reloads_and_vllm_scores_with_fresh_weights(tmp_path):
    """Each call in the order of trainers/colocation.py, vLLM's log-probs of fixed sequences after the turn equal
    the trainer's after its step to 1e-4 (the step moved them by far more), and a push into the sleeping engine
    is refused rather than lost."""
    pytest.importorskip("vllm")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "model")], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["calls"] == [
        "vllm.sleep",  # from construction until the first generation
        "vllm.update_weights",  # the push into the sleeping engine (refused)
        "train",
        "vllm.wake_up['weights']", "vllm.update_weights", "deepspeed.offload_states", "vllm.wake_up['kv_cache']",
        "generate",
        "vllm.sleep", "deepspeed.reload_states",
    ], report["calls"]
    assert "on a sleeping vLLM engine" in report["asleep_push"]
    assert report["diff"] < 1e-4, report
    assert report["moved"] > 1e-2, report
