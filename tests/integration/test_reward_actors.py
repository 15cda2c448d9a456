"""Reward models, the reference and a distillation teacher as Ray actor groups (`train_ppo --reward_pretrain DIR`,
`--ref_num_nodes 1`, `--teacher_num_nodes 1` under `--launcher ray`): the same run as with them inside the ranks,
and a killed reward actor named by the driver.

The PPO run of test_ppo_critic.py (a tiny reward model with a saved normalisation, the critic started from it,
HF rollouts), one Ray rank: the rewards come from an actor of their own or from rank 0, and every metric and
final weight must agree to 1e-5.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from saved_runs import assert_same_run, read_metrics
from test_ppo_critic import COMMON, LAYOUTS, ppo_argv
from hang_guard import HANG_S

pytest.importorskip("ray")
RAY = [*COMMON[:-2], "--launcher", "ray", "--num_gpus_per_node", "1", *LAYOUTS["packed_dynamic"]]
assert COMMON[-2:] == ["--launcher", "local"]


def run(save_path, root, *flags, wait=True):
    argv = [sys.executable, "-m", "openpack.cli.main", "train_ppo", *ppo_argv(save_path, root)[:-len(COMMON)],
            *RAY, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if wait is not True:  # a file for stdout: started, not waited for
        return subprocess.Popen(argv, env=env, stdout=wait, stderr=subprocess.PIPE, text=True)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.slow
def test_reward_reference_and_teacher_actor_groups_equal_the_models_in_the_ranks(ppo_models, tmp_path):
    """Two ranks, the KL term on (COMMON's --init_kl_coef 0.05) and a distillation teacher (the reward model's
    causal-LM base, which shares the tokenizer) beside the reward: the reward model, the reference and the teacher
    each in an actor group of their own, which both ranks ask for their shares, give the same run to 1e-5 as all
    inside the ranks (`--colocate_critic_reward`: the reward model in rank 0; the reference and the teacher in
    every rank, the default). One run of each layout checks every group: each Ray run costs a cluster start."""
    two_ranks = ["--num_gpus_per_node", "2", "--teacher_pretrain", str(ppo_models / "rm_base"), "--distill_coef",
                 "0.1"]
    out = run(tmp_path / "actors", ppo_models, *two_ranks, "--ref_num_nodes", "1", "--teacher_num_nodes", "1")
    assert f"ray: placing 1 reward model {ppo_models / 'rm'} actors" in out
    assert "ray: placing 1 reference actors" in out and "ray: placing 1 teacher actors" in out
    out = run(tmp_path / "in_ranks", ppo_models, *two_ranks, "--colocate_critic_reward")
    assert "reward model" not in out and "reference actors" not in out and "teacher actors" not in out
    assert_same_run(tmp_path / "actors", tmp_path / "in_ranks")
    for a, b in zip(read_metrics(tmp_path / "actors"), read_metrics(tmp_path / "in_ranks")):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
    assert read_metrics(tmp_path / "actors")[-1]["kl"] != 0  # k1: a mean of log-ratios, either sign
    assert all(m["distill/reverse_kl"] != 0 for m in read_metrics(tmp_path / "actors"))  # the teacher scored


@pytest.mark.slow
def test_a_killed_reward_actor_is_named_and_the_run_ends(ppo_models, tmp_path):
    """SIGKILL the reward actor once the first rollout batch is trained: the next reward call meets a dead actor,
    and the driver names the reward model and its node and exits 1 within 60 s."""
    log = tmp_path / "stdout.txt"
    with open(log, "w") as out:
        proc = run(tmp_path / "killed", ppo_models, "--max_steps", "50", "--logging_steps", "1", wait=out)
        try:
            pid = wait_for(lambda: re.search(r"ray: reward model \S+ 0 pid (\d+) on node", log.read_text()))
            metrics = tmp_path / "killed" / "metrics.jsonl"
            wait_for(lambda: metrics.exists() and metrics.read_text().strip())
            os.kill(int(pid.group(1)), signal.SIGKILL)
            killed = time.monotonic()
            _, err = proc.communicate(timeout=60)
            seconds = time.monotonic() - killed
        finally:
            proc.kill()
    assert proc.returncode == 1, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert f"reward model {ppo_models / 'rm'}: actor 0 of 1 on node " in last, last
    assert "died" in last and seconds < 60
    print(f"named and exited {seconds:.1f} s after the SIGKILL: {last}")


def wait_for(found, timeout: float = HANG_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")
