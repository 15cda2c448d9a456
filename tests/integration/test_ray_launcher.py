"""--launcher ray: one Ray actor per rank (CPU workers here) gives the same run as the local launcher.

Each test runs the real CLI in a subprocess, so the Ray cluster it starts is
torn down with it. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray resolve
every node address to loopback, so all test traffic stays on 127.0.0.1.
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


LOOPBACK_RAY = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def openpack(*argv):
    return subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                          timeout=300, env=LOOPBACK_RAY)


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


TWO_NODES = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # all traffic stays on loopback
from openpack.cli import train_sft
code = train_sft.main(sys.argv[1:] + ["--launcher", "ray", "--ray_address", cluster.address,
                                      "--num_nodes", "2", "--num_gpus_per_node", "1"])
import ray
ray.shutdown()  # the driver disconnects before the cluster's nodes go
cluster.shutdown()
sys.exit(code)
"""


@pytest.mark.slow
def test_simulated_two_node_cluster(tmp_path, tiny_pretrain, sft_jsonl):
    """Two Ray nodes of one CPU each: one rank lands on each, and the run equals one local rank."""
    argv = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *COMMON]
    local = openpack("train_sft", *argv, "--save_path", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr[-3000:]
    result = subprocess.run([sys.executable, "-c", TWO_NODES, *argv, "--save_path", str(tmp_path / "two_nodes")],
                            capture_output=True, text=True, timeout=300, env=LOOPBACK_RAY)
    assert result.returncode == 0, result.stderr[-3000:]
    nodes = {line.split(" on node ")[1] for line in result.stdout.splitlines() if line.startswith("ray: rank ")}
    assert len(nodes) == 2, result.stdout
    assert_same_run(tmp_path / "two_nodes", tmp_path / "local")


@pytest.mark.slow
def test_a_killed_worker_is_reported_and_the_driver_exits(tmp_path, tiny_pretrain, sft_jsonl):
    import re
    import signal
    import time

    argv = ["train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *COMMON, "--max_steps", "100000",
            "--save_steps", "1", "--save_path", str(tmp_path / "run"), "--launcher", "ray", "--num_gpus_per_node", "2"]
    driver = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=LOOPBACK_RAY)
    pids, lines, deadline = {}, [], time.time() + 240
    for line in driver.stdout:  # wait until rank 1 is known and a checkpoint exists
        lines.append(line)
        if match := re.match(r"ray: rank (\d) pid (\d+)", line):
            pids[int(match[1])] = int(match[2])
        if "step 2/" in line or time.time() > deadline:
            break
    assert 1 in pids, "".join(lines[-40:])
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.time()
    output, _ = driver.communicate(timeout=120)
    assert driver.returncode != 0
    assert time.time() - killed_at < 60
    assert "rank 1 on node" in output and "--load_checkpoint" in output, output[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()
