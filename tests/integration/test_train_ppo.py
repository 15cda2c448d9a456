"""openpack train_ppo / train_grpo end to end on CPU: the update is exact under packing, micro-batching and
world size; vLLM's log-probs agree with the trainer's before and after every weight sync.

Two rollout batches of 4 prompts x 4 completions, cut into optimizer steps of 8 completions, 2 PPO epochs
(so 4 updates per batch: the old-policy pass, clipping and the optimizer state all matter), a KL penalty
against a reference in the reward, a rule reward with spread inside each group. HF generation seeds each
chunk of prompts by its prompts' seeds, so every layout and world size samples the same completions; then
every token weight comes from the step's counts and every layout must give the same losses, grad norms and
final weights to 1e-5 in fp32.
"""

import os
import subprocess
import sys

import pytest

from openpack.cli import train_grpo, train_ppo
from openpack.distributed.process import free_port

from hang_guard import HANG_S
from saved_runs import assert_same_run, read_metrics

COMMON = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "2",
          "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
          "--max_norm", "100", "--adam_epsilon", "1e-6", "--max_steps", "2", "--init_kl_coef", "0.05",
          "--rollout_backend", "hf", "--launcher", "local"]
LAYOUTS = {
    "packed_dynamic": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96", "--no_prefix_sharing"],
    "padded_8x1": ["--micro_train_batch_size", "1"],
    "padded_1x8": ["--micro_train_batch_size", "8"],
    # prompt | completion | ... per group in every pass; at 40 tokens (the longest prompt + completion) most groups
    # are split into units with a copy of the prompt each
    "prefix_shared": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96"],  # the default
    "prefix_shared_split": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "40"],
}
AGGREGATIONS = {  # each with the KL where its method puts it
    "token_mean": [],
    "seq_mean_token_mean": ["--use_kl_loss", "--kl_estimator", "k3"],
    "seq_mean_token_sum_norm": ["--advantage_estimator", "dr_grpo"],
}


def grpo(save_path, root, *flags):
    argv = ["--pretrain", str(root / "model"), "--prompt_data", str(root / "prompts.jsonl"),
            "--reward_fn", f"{root / 'reward.py'}:reward", "--save_path", str(save_path), *COMMON, *flags]
    assert train_grpo.main(argv) == 0
    return save_path


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, rl_model):
    return {mode: grpo(tmp_path_factory.mktemp(f"ppo_{mode}"), rl_model, "--loss_agg_mode", mode, *flags,
                       *LAYOUTS["packed_dynamic"]) for mode, flags in AGGREGATIONS.items()}


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
@pytest.mark.parametrize("layout", ["padded_8x1", "padded_1x8", "prefix_shared", "prefix_shared_split"])
def test_layouts_give_the_same_steps(layout, mode, reference_runs, tmp_path, rl_model):
    if layout == "padded_1x8" and mode != "token_mean":
        pytest.skip("one aggregation is enough for the second padded layout")
    if (layout == "prefix_shared_split") != (mode == "token_mean") and layout.startswith("prefix_shared"):
        pytest.skip("token_mean with split groups, the other aggregations with whole groups")
    run = grpo(tmp_path / layout, rl_model, "--loss_agg_mode", mode, *AGGREGATIONS[mode], *LAYOUTS[layout])
    assert_same_run(run, reference_runs[mode])
    if layout.startswith("prefix_shared"):  # the prompts really were computed fewer times
        for m in read_metrics(run):
            assert m["prefix_sharing/token_ratio"] < 0.9, m
            assert (m["prefix_sharing/split_groups"] > 0) == (layout == "prefix_shared_split"), m


POLICY_LOSSES = {  # two updates per rollout batch, so the second one's ratios are not 1; an entropy bonus on both
    "gspo": ["--policy_loss_type", "gspo", "--dual_clip", "3", "--entropy_coef", "0.01",
             "--loss_agg_mode", "seq_mean_token_mean"],
    "cispo": ["--policy_loss_type", "cispo", "--entropy_coef", "0.01"],
}


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_policy_losses_give_the_same_steps_packed_and_padded(loss, reference_runs, tmp_path, rl_model):
    """GSPO's ratio per completion (its tokens spread over a packed row with shared prompts, groups split at the row
    cap), CISPO's weights, the dual clip and the entropy bonus's gradient: packed == one completion per micro-batch,
    to 1e-5 in losses, grad norms and weights; and the loss is not PPO's (GSPO's 3e-4/4e-4 range clips at the
    second update, CISPO logs another loss than the token_mean PPO run on the same batches)."""
    packed = grpo(tmp_path / "packed", rl_model, *POLICY_LOSSES[loss], *LAYOUTS["prefix_shared_split"])
    assert_same_run(packed, grpo(tmp_path / "padded", rl_model, *POLICY_LOSSES[loss], *LAYOUTS["padded_8x1"]))
    metrics, ppo = read_metrics(packed), read_metrics(reference_runs["token_mean"])
    if loss == "gspo":
        assert all(m["clip_ratio"] > 0 for m in metrics), metrics
    else:
        assert all(abs(m["policy_loss"] - p["policy_loss"]) > 1e-3 for m, p in zip(metrics, ppo)), (metrics, ppo)


def test_metrics_are_named_as_peers_name_them(reference_runs):
    metrics = read_metrics(reference_runs["token_mean"])
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("reward", "reward_std", "advantages/mean", "advantages/std", "kl", "policy_loss", "clip_ratio",
                    "entropy", "response_length/mean", "response_length/max", "response_length/truncated",
                    "vllm_logp_diff", "time/generation", "time/weight_sync", "time/experience", "time/training",
                    "generation_tokens_per_s", "training_tokens_per_s"):
            assert key in m, key
        assert m["optimizer_steps"] == 4  # 16 completions in steps of 8, 2 epochs
        assert m["reward_std"] > 0 and m["advantages/std"] > 0  # the groups really disagree: gradients are not zero
        assert 0 < m["entropy"] < 4  # nats, under ln(46) for a 46-token vocabulary
        assert m["vllm_logp_diff"] < 1e-4  # HF generation's log-probs vs the trainer's, same weights
    assert metrics[1]["kl"] > 0  # the policy moved away from the reference after the first batch
    assert (reference_runs["token_mean"] / "reward.png").exists()


@pytest.mark.slow
def test_two_ranks_equal_one_rank(reference_runs, tmp_path, rl_model):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_grpo", "--pretrain", str(rl_model / "model"), "--prompt_data",
           str(rl_model / "prompts.jsonl"), "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path",
           str(tmp_path / "two"), *COMMON[:-2], "--loss_agg_mode", "token_mean", *LAYOUTS["packed_dynamic"]]
    assert COMMON[-2:] == ["--launcher", "local"]  # under torchrun each process is a rank whatever --launcher says
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(tmp_path / "two", reference_runs["token_mean"])


VLLM_FLAGS = ["--rollout_backend", "vllm", "--vllm_is_correction_cap", "2", "--zero_stage", "3",
              *LAYOUTS["packed_dynamic"]]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, rl_model):
    """In a subprocess, as a user runs it: an in-process vLLM engine tears down torch.distributed's default group
    when it shuts down, which would leave DeepSpeed's cached groups stale for the next in-process test. Its
    console (stdout, then stderr) is kept next to the save path, in console.txt."""
    save_path = tmp_path_factory.mktemp("vllm") / "run"
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(save_path), *COMMON, *VLLM_FLAGS]
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_grpo", *argv], capture_output=True,
                            text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    (save_path.parent / "console.txt").write_text(result.stdout + result.stderr)
    return save_path


@pytest.mark.vllm
def test_vllm_rollouts_match_the_trainer_before_and_after_every_sync(vllm_run):
    """Step 1 samples from the starting weights (the trainer/vLLM ratio is 1), step 2 from weights synced after
    four updates, gathered one parameter at a time under ZeRO-3: vLLM's log-probs of its own samples equal the
    trainer's to 1e-4 both times."""
    metrics = read_metrics(vllm_run)
    for m in metrics:
        assert m["vllm_logp_diff"] < 1e-4, m
        assert m["tis_clip_ratio"] == 0.0  # the importance weight is 1 everywhere when the weights agree
        assert m["time/weight_sync"] > 0
    assert metrics[1]["kl"] > 0


@pytest.mark.vllm
def test_a_vllm_run_prints_only_what_a_user_acts_on(vllm_run):
    """Issue 24, item 3: no traceback (vLLM's chat-template warm-up logged one at every engine start), no tqdm bars,
    no colour codes in a pipe; vLLM's start output is in the engine's log file instead, and every step's line shows
    vllm_logp_diff (it was only in metrics.jsonl)."""
    console = (vllm_run.parent / "console.txt").read_text()
    for noise in ("Traceback", "Chat template warmup failed", "Writing model shards", "Loading weights", "\x1b[",
                  "LD_PRELOAD", "FutureWarning", "NUMA", "Using None for EOS token id"):
        assert noise not in console, (noise, console[-4000:])
    steps = [line for line in console.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("  vllm_logp_diff " in line for line in steps), steps
    [log] = (vllm_run / "logs").glob("vllm_engine-*.log")
    # vLLM's start output is there. (Whether it holds the warm-up record varies: a fresh-clone CI run's log had the
    # FutureWarnings and the loading bar but no warm-up record, where this machine's had it.)
    assert "Loading safetensors checkpoint shards" in log.read_text()


@pytest.mark.parametrize("flags, message", [
    (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1"], "--n_samples_per_prompt >= 2"),
    (["--train_batch_size", "5"], "does not split into steps of --train_batch_size"),
    (["--use_kl_loss", "--init_kl_coef", "0"], "--use_kl_loss with --init_kl_coef 0"),
    (["--rollout_backend", "hf", "--vllm_is_correction_cap", "2"], "drop it"),
    (["--rollout_backend", "hf", "--zero_stage", "3", "--launcher", "ray", "--num_gpus_per_node", "2"],
     "use --rollout_backend vllm, or --zero_stage 2"),
    (["--prefix_sharing"], "add --packing_samples --use_dynamic_batch, or drop --prefix_sharing"),
])
def test_bad_flags_are_named(flags, message, rl_model, tmp_path, capsys):
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(tmp_path), "--launcher", "local",
            "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--train_batch_size", "8", *flags]
    assert train_ppo.main(argv) == 2
    assert message in capsys.readouterr().err


def test_vllm_under_torchrun_is_refused(rl_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(tmp_path), "--rollout_batch_size",
            "4", "--n_samples_per_prompt", "4", "--train_batch_size", "8", "--rollout_backend", "vllm"]
    assert train_grpo.main(argv) == 2
    assert "run as Ray actors: use --launcher ray" in capsys.readouterr().err


def test_no_reward_is_an_error(rl_model, tmp_path, capsys):
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--save_path", str(tmp_path), "--launcher", "local", "--rollout_batch_size", "4",
            "--train_batch_size", "4", "--rollout_backend", "hf"]
    assert train_ppo.main(argv) == 2
    assert "no reward: give --reward_fn" in capsys.readouterr().err
