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

from hang_guard import HANG_S
from saved_runs import read_metrics

SCRIPT = Path(__file__).with_name("colocation_script.py")
TURN = ["deepspeed.offload_states", "deepspeed.reload_states"]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_turn_wakes_pushes_offloads_generates_sleeps_reloads_and_vllm_scores_with_fresh_weights(tmp_path):
    """Each call in the order of rl/colocation.py, vLLM's log-probs of fixed sequences after the turn equal
    the trainer's after its step to 1e-4 (the step moved them by far more), and a push into the sleeping engine
    is refused rather than lost."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "model")], env=env, capture_output=True,
                            text=True, timeout=HANG_S)
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


COMMON = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "2",
          "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
          "--max_steps", "3", "--init_kl_coef", "0.05", "--packing_samples", "--use_dynamic_batch",
          "--max_tokens_per_gpu", "96", "--rollout_backend", "vllm", "--colocate_all_models"]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_colocated_ray_run_samples_with_the_trainers_weights_at_every_step(rl_model, tmp_path):
    """Two Ray ranks under ZeRO-3 with the engine on rank 0's bundle: every rollout is sampled right after a wake
    and a push, so vLLM's log-probs equal the trainer's at every step (< 1e-4), the first included."""
    argv = ["train_grpo", "--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(tmp_path / "run"), *COMMON,
            "--zero_stage", "3", "--launcher", "ray", "--num_gpus_per_node", "2"]
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                            timeout=HANG_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ray: vllm engine 0 pid" in result.stdout
    assert "ray: placing 1 vllm engine" not in result.stdout  # no placement group of its own
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["vllm_logp_diff"] < 1e-4, m
        assert m["time/weight_sync"] > 0  # pushed at every wake, the first too
    assert metrics[-1]["kl"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--async_train"], "generation and training cannot overlap"),
    (["--rollout_backend", "hf"], "with --rollout_backend hf the policy already generates"),
    (["--vllm_num_engines", "2"], "--vllm_num_engines 2 must be at most the 1 rank(s)"),
    (["--vllm_tensor_parallel_size", "2"], "tensor-parallel colocated engines are not built"),
    (["--ref_num_nodes", "1", "--init_kl_coef", "0.01"], "drop --ref_num_nodes"),
])
def test_what_colocation_cannot_do_is_refused(flags, message, rl_model, tmp_path, capsys):
    from openpack.cli import train_ppo

    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(tmp_path), *COMMON, *flags]
    assert train_ppo.main(argv) == 2
    assert message in capsys.readouterr().err
