"""--launcher ray: one Ray actor per rank (CPU workers here) gives the same run as the local launcher.

Each test runs the real CLI in a subprocess, so the Ray cluster it starts on
127.0.0.1 is torn down with it.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import assert_same_run

COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
          "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100",
          "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128"]


def openpack(*argv):
    return subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RAY_DEDUP_LOGS": "0"})


@pytest.mark.slow
def test_two_ray_workers_equal_one_local_rank(tmp_path, tiny_pretrain, sft_jsonl):
    data = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *COMMON]
    local = openpack("train_sft", *data, "--save_path", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr[-3000:]
    ray = openpack("train_sft", *data, "--save_path", str(tmp_path / "ray"), "--launcher", "ray",
                   "--num_gpus_per_node", "2", "--num_cpus_per_worker", "1")
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert "step 2/2" in ray.stdout + ray.stderr  # rank 0's progress reaches the driver's console
    assert_same_run(tmp_path / "ray", tmp_path / "local")


@pytest.mark.slow
def test_a_worker_data_error_reaches_the_user_as_one_line(tmp_path, tiny_pretrain):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "ab", "response": "ba"}) + "\n")
    result = openpack("train_sft", "--pretrain", tiny_pretrain, "--dataset", str(bad), "--save_path",
                      str(tmp_path / "out"), "--launcher", "ray", "--num_gpus_per_node", "2", *COMMON)
    assert result.returncode == 2
    assert "bad.jsonl:1: no key 'prompt'" in result.stderr
