"""Ray, the default launcher: one actor per rank (CPU workers here) gives the same run as one local process.

Each Ray test runs the real CLI in a subprocess, so the Ray cluster it starts
is torn down with it. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray
resolve every node address to loopback, so all test traffic stays on
127.0.0.1. The local baselines run in-process with ``--launcher local``.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_same_run, read_metrics
from openpack.cli import train_dpo

SFT = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
       "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100",
       "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128"]
DPO = [*SFT[:12], "--max_len", "48", "--seed", "1", "--max_norm", "100", "--loss_type", "sigmoid",
       "--nll_loss_coef", "0.5", "--beta", "0.5", "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu",
       "160"]
FOREVER = ["--max_epochs", "100000", "--max_steps", "100000"]  # a run that is still going when the test stops it
TWO_WORKERS = ["--num_gpus_per_node", "2", "--num_cpus_per_worker", "1"]

LOOPBACK_RAY = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def openpack(*argv):
    return subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                          timeout=300, env=LOOPBACK_RAY)


def rank_pids(output: str) -> dict[int, int]:
    return {int(m[1]): int(m[2]) for m in re.finditer(r"ray: rank (\d+) pid (\d+)", output)}


@pytest.fixture(scope="module")
def dpo_args(tiny_pretrain, tiny_reference, dpo_jsonl):
    return ["--pretrain", tiny_pretrain, "--ref_pretrain", tiny_reference, "--dataset", dpo_jsonl, *DPO]


@pytest.fixture(scope="module")
def local_dpo(tmp_path_factory, dpo_args):
    """One local process, reference colocated: the run every Ray layout must reproduce."""
    save_path = tmp_path_factory.mktemp("local_dpo")
    assert train_dpo.main([*dpo_args, "--save_path", str(save_path), "--launcher", "local"]) == 0
    return save_path


@pytest.mark.slow
def test_dpo_runs_through_ray_by_default_and_two_workers_equal_one_local_rank(tmp_path, dpo_args, local_dpo):
    result = openpack("train_dpo", *dpo_args, "--save_path", str(tmp_path / "ray"), *TWO_WORKERS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(rank_pids(result.stdout)) == [0, 1]  # no --launcher given: Ray
    assert "step 2/2" in result.stdout + result.stderr  # rank 0's progress reaches the driver's console
    assert_same_run(tmp_path / "ray", local_dpo)


@pytest.mark.slow
def test_separate_reference_group_equals_colocated(tmp_path, dpo_args, local_dpo):
    """2 policy ranks and 2 reference actors (ZeRO-3 inside each group) == 1 local rank with its own reference."""
    result = openpack("train_dpo", *dpo_args, "--save_path", str(tmp_path / "ref_group"), *TWO_WORKERS,
                      "--zero_stage", "3", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"ray: reference \d pid", result.stdout)) == 2, result.stdout
    assert_same_run(tmp_path / "ref_group", local_dpo)


def test_reference_group_flag_checks(dpo_args, tmp_path, capsys):
    out = ["--save_path", str(tmp_path)]
    assert train_dpo.main([*dpo_args, *out, "--launcher", "local", "--ref_num_nodes", "1"]) == 2
    assert "needs --launcher ray" in capsys.readouterr().err
    assert train_dpo.main([*dpo_args, *out, "--num_gpus_per_node", "3", "--ref_num_nodes", "1",
                           "--ref_num_gpus_per_node", "2"]) == 2
    assert "must divide the 3 policy ranks" in capsys.readouterr().err
    assert train_dpo.main([*dpo_args, *out, "--ref_num_nodes", "1", "--ref_logps_cache", str(tmp_path / "c")]) == 2
    assert "drop one of them" in capsys.readouterr().err


TWO_NODES = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # all traffic stays on loopback
from openpack.cli import train_dpo
import os
os.environ["RAY_ADDRESS"] = cluster.address  # as `ray job submit` sets it for the command
code = train_dpo.main(sys.argv[1:] + ["--num_nodes", "2", "--num_gpus_per_node", "1"])
import ray
ray.shutdown()  # the driver disconnects before the cluster's nodes go
cluster.shutdown()
sys.exit(code)
"""


@pytest.mark.slow
def test_simulated_two_node_cluster(tmp_path, dpo_args, local_dpo):
    """Two Ray nodes of one CPU each: one rank lands on each, and train_dpo equals one local rank."""
    result = subprocess.run([sys.executable, "-c", TWO_NODES, *dpo_args, "--save_path", str(tmp_path / "two_nodes")],
                            capture_output=True, text=True, timeout=300, env=LOOPBACK_RAY)
    assert result.returncode == 0, result.stderr[-3000:]
    nodes = {line.split(" on node ")[1] for line in result.stdout.splitlines() if line.startswith("ray: rank ")}
    assert len(nodes) == 2, result.stdout
    assert_same_run(tmp_path / "two_nodes", local_dpo)


@pytest.mark.slow
def test_two_ray_workers_equal_one_local_rank_sft(tmp_path, tiny_pretrain, sft_jsonl):
    data = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *SFT]
    local = openpack("train_sft", *data, "--save_path", str(tmp_path / "local"), "--launcher", "local")
    assert local.returncode == 0, local.stderr[-3000:]
    ray = openpack("train_sft", *data, "--save_path", str(tmp_path / "ray"), *TWO_WORKERS)
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert_same_run(tmp_path / "ray", tmp_path / "local")


@pytest.mark.slow
def test_a_worker_data_error_reaches_the_user_as_one_line(tmp_path, tiny_pretrain):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "ab", "response": "ba"}) + "\n")
    result = openpack("train_sft", "--pretrain", tiny_pretrain, "--dataset", str(bad), "--save_path",
                      str(tmp_path / "out"), *TWO_WORKERS, *SFT)
    assert result.returncode == 2
    assert "bad.jsonl:1: no key 'prompt'" in result.stderr


def start_long_run(save_path, tiny_pretrain, sft_jsonl):
    """A Ray run of 2 workers checkpointing every step; returns the driver, rank pids and output once step 2 is done."""
    argv = ["train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *SFT, *FOREVER, "--save_steps", "1",
            "--save_path", str(save_path), *TWO_WORKERS]
    driver = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=LOOPBACK_RAY)
    lines, deadline = [], time.time() + 240
    for line in driver.stdout:
        lines.append(line)
        if "step 2/" in line or time.time() > deadline:
            break
    pids = rank_pids("".join(lines))
    assert sorted(pids) == [0, 1], "".join(lines[-40:])
    return driver, pids, lines


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc), zombies excluded."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_killed_worker_is_reported_and_the_run_resumes(tmp_path, tiny_pretrain, sft_jsonl):
    driver, pids, _ = start_long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.time()
    output, _ = driver.communicate(timeout=120)
    assert driver.returncode != 0
    assert time.time() - killed_at < 60
    assert "rank 1 on node" in output and "--load_checkpoint" in output, output[-3000:]
    latest = int((tmp_path / "run" / "checkpoints" / "latest").read_text().strip().removeprefix("global_step"))
    resumed = openpack("train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *SFT, "--save_path",
                       str(tmp_path / "run"), *TWO_WORKERS, *FOREVER, "--load_checkpoint", "--max_steps", str(latest + 1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'} at step {latest}" in resumed.stdout + resumed.stderr
    assert read_metrics(tmp_path / "run")[-1]["step"] == latest + 1


@pytest.mark.slow
def test_ctrl_c_stops_every_worker(tmp_path, tiny_pretrain, sft_jsonl):
    driver, pids, _ = start_long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    tree = descendants(driver.pid)  # the local cluster's processes and the rank actors
    assert set(pids.values()) <= tree
    driver.send_signal(signal.SIGINT)
    output, _ = driver.communicate(timeout=60)
    assert driver.returncode == 130, output[-3000:]
    assert "interrupted; all Ray workers were stopped" in output
    deadline = time.time() + 20
    while any(alive(pid) for pid in tree) and time.time() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in tree if alive(pid)], "orphans left behind"
