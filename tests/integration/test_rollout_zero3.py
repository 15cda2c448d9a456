"""Weight sync's parameter stream under ZeRO-3 on 2 gloo ranks (torchrun): every tensor arrives whole and
equal to the unpartitioned model's, under its HF name, in whole-layer buckets, and the parameters are
partitioned again afterwards (gathered one at a time, never the whole model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openpack.distributed.process import free_port
from hang_guard import HANG_S

SCRIPT = Path(__file__).with_name("rollout_zero3_script.py")


@pytest.mark.slow
def test_policy_weights_gather_zero3_parameters_one_by_one():
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(SCRIPT)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert report == {"names": True, "equal": True, "buckets": report["buckets"], "partitioned_after": True}
    assert report["buckets"] > 2
