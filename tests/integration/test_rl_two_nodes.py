"""PPO on a simulated two-node Ray cluster: every actor of the multi-node layout placed, and the run equal to one
local process.

``ray.cluster_utils.Cluster`` starts two Ray nodes on this machine (loopback only). The driver runs
``openpack train_ppo`` against it with everything docs/rl.md's multi-node example has: 2 training ranks (policy,
critic and reference in each, ZeRO-3), a vLLM engine actor and a reward-model actor group. Who lands where is
made certain by the order the driver places things: the head node has 3 CPUs and starts alone, so the engine
(placed first) and the reward model take two of them; when the driver prints that it places the ranks, the second
node (1 CPU) joins, and the ranks' group of two 1-CPU bundles can only be placed one on each node (which rank
lands on which node is Ray's choice):

```
head node (3 CPUs)   [vllm engine 0] [reward model rm] [rank 0 or 1]
second node (1 CPU)                                    [the other rank]
```

The same flags with ``--launcher local`` (one rank, vLLM in its process, the reward model loaded by that rank)
must give the same run: vLLM seeds every request from ``--seed`` and the prompt's place, so both sample the same
completions, and the losses are normalised over the whole step, so 1 rank == 2 ranks.
"""

import os
import re
import subprocess
import sys

import pytest

from hang_guard import HANG_S
from saved_runs import assert_same_critic, assert_same_run, read_metrics

PPO = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--rollout_backend", "vllm", "--zero_stage", "3",
       "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "1",
       "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--critic_learning_rate",
       "5e-3", "--seed", "1", "--max_norm", "100", "--adam_epsilon", "1e-6", "--max_steps", "2",
       "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96"]

TWO_NODES = """
import os, signal, subprocess, sys
from ray.cluster_utils import Cluster

os.environ["RAY_worker_niceness"] = "0"  # as openpack's own clusters: Ray's 15 starves the workers on a busy machine

def too_long(*_):
    raise TimeoutError("the run hit its hang guard (SIGALRM)")

signal.signal(signal.SIGALRM, too_long)
signal.alarm(HANG_S - 60)  # before the test's own timeout (HANG_S), so the cluster is always shut down here
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "node_ip_address": "127.0.0.1"})
driver = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", "train_ppo", *sys.argv[1:], "--ray_address",
                           cluster.address, "--num_nodes", "2", "--num_gpus_per_node", "1", "--num_cpus_per_worker",
                           "1"], stdout=subprocess.PIPE, text=True)
try:
    for line in driver.stdout:
        print(line, end="", flush=True)
        if line.startswith("ray: placing 2 rank actors"):  # the engine and the reward model hold 2 of the head's CPUs
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # all traffic stays on loopback
    code = driver.wait()
finally:
    driver.kill()
    cluster.shutdown()
sys.exit(code)
"""

TWO_NODES = TWO_NODES.replace("HANG_S", str(HANG_S))
ENV = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def ppo_argv(root, save_path, *flags):
    return ["--pretrain", str(root / "model"), "--prompt_data", str(root / "prompts.jsonl"), "--reward_pretrain",
            str(root / "rm"), "--save_path", str(save_path), *PPO, *flags]


def placed(output: str) -> dict[str, str]:
    """``{"rank 0": node, "vllm engine 0": node, ...}`` from the driver's ``ray: <actor> pid <pid> on node`` lines."""
    return {m[1]: m[2] for m in re.finditer(r"^ray: (.+?) pid \d+ on node (\S+)$", output, re.M)}


@pytest.mark.vllm
@pytest.mark.slow
def test_ppo_on_two_nodes_places_every_actor_and_equals_one_local_process(ppo_models, tmp_path):
    local = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_ppo",
                            *ppo_argv(ppo_models, tmp_path / "local", "--launcher", "local")],
                           capture_output=True, text=True, timeout=HANG_S, env=ENV)
    assert local.returncode == 0, local.stderr[-4000:]
    ray = subprocess.run([sys.executable, "-c", TWO_NODES, *ppo_argv(ppo_models, tmp_path / "two_nodes")],
                         capture_output=True, text=True, timeout=HANG_S, env=ENV)
    assert ray.returncode == 0, ray.stderr[-4000:]

    where = placed(ray.stdout)
    assert {"rank 0", "rank 1", "vllm engine 0", f"reward model {ppo_models / 'rm'} 0"} <= where.keys(), ray.stdout
    assert where["rank 0"] != where["rank 1"], where
    assert where["vllm engine 0"] == where[f"reward model {ppo_models / 'rm'} 0"] in (where["rank 0"], where["rank 1"])

    metrics = read_metrics(tmp_path / "two_nodes")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert "critic_loss" in m and "kl" in m, m
        assert m["vllm_logp_diff"] < 1e-4, m  # before the first sync and after it
    assert metrics[1]["kl"] > 0  # the policy moved away from the reference
    assert_same_run(tmp_path / "two_nodes", tmp_path / "local")
    assert_same_critic(tmp_path / "two_nodes", tmp_path / "local")
