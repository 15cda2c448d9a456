"""PPO with a critic and a reward model (`openpack train_ppo --advantage_estimator gae --reward_pretrain DIR`) on CPU:
the actor's and the critic's updates are exact under packing, micro-batching and world size, and a resumed run
equals an uninterrupted one, critic and adaptive KL coefficient included.

Two rollout batches of 4 prompts x 4 completions (HF generation, seeded per chunk, so every layout samples the
same completions), cut into optimizer steps of 8 completions, 2 PPO epochs: 4 actor and 4 critic updates per
batch. The reward is a tiny reward model saved as `openpack train_rm` saves one (a one-label sequence
classifier with a normalisation in its config); the critic starts from it; the reward's KL penalty has an
adaptive coefficient; the rewards are clipped and DAPO's overlong penalty applies. Every layout must give the
same actor and critic losses, grad norms and final weights to 1e-5 in fp32.
"""

import os
import subprocess
import sys

import pytest

from openpack.cli import train_ppo
from openpack.distributed.process import free_port

from hang_guard import HANG_S
from saved_runs import assert_same_critic, assert_same_run, read_metrics

COMMON = ["--advantage_estimator", "gae", "--gamma", "0.9", "--lambd", "0.8", "--value_clip", "0.2",
          "--critic_learning_rate", "5e-3", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
          "--train_batch_size", "8", "--max_epochs", "2", "--generate_max_len", "8", "--prompt_max_len", "32",
          "--learning_rate", "1e-3", "--seed", "1", "--max_norm", "100", "--adam_epsilon", "1e-6", "--max_steps", "2",
          "--init_kl_coef", "0.05", "--target_kl", "0.001", "--kl_horizon", "32", "--reward_clip_range", "-1.5", "1.5",
          "--overlong_buffer_len", "4", "--overlong_penalty_factor", "0.5", "--rollout_backend", "hf",
          "--launcher", "local"]
LAYOUTS = {
    "packed_dynamic": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96", "--no_prefix_sharing"],
    "padded_8x1": ["--micro_train_batch_size", "1"],
    "padded_1x8": ["--micro_train_batch_size", "8"],
    "prefix_shared": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96"],  # the default
}


def ppo_argv(save_path, root, *flags):
    return ["--pretrain", str(root / "model"), "--prompt_data", str(root / "prompts.jsonl"), "--reward_pretrain",
            str(root / "rm"), "--save_path", str(save_path), *COMMON, *flags]


def ppo(save_path, root, *flags):
    assert train_ppo.main(ppo_argv(save_path, root, *flags)) == 0
    return save_path


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, ppo_models):
    return ppo(tmp_path_factory.mktemp("ppo_packed"), ppo_models, *LAYOUTS["packed_dynamic"])


def test_the_critic_learns_and_the_reward_model_scores(reference_run):
    metrics = read_metrics(reference_run)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("critic_loss", "critic_grad_norm", "value_clip_ratio", "values", "returns", "kl", "kl_coef",
                    "reward/overlong_penalty", "reward/source", "policy_loss"):
            assert key in m, key
        assert m["optimizer_steps"] == 4
        assert m["critic_grad_norm"] > 0 and m["reward_std"] > 0
        assert -1.5 <= m["reward"] <= 1.5
    # the adaptive controller moved the coefficient: KL above the target raises it, below lowers it
    first, second = metrics
    assert second["kl_coef"] != first["kl_coef"] == pytest.approx(0.05)
    assert (second["kl_coef"] > first["kl_coef"]) == (first["kl"] > 0.001)
    assert (reference_run / "critic" / "config.json").exists()  # the critic is exported next to the policy


@pytest.mark.parametrize("layout", ["padded_8x1", "padded_1x8"])
def test_layouts_give_the_same_actor_and_critic(layout, reference_run, tmp_path, ppo_models):
    run = ppo(tmp_path / layout, ppo_models, *LAYOUTS[layout])
    assert_same_run(run, reference_run)
    assert_same_critic(run, reference_run)


def test_resumed_run_equals_the_uninterrupted_one(reference_run, tmp_path, ppo_models):
    """Stopped after the first rollout batch (its checkpoint holds the critic and the KL coefficient), resumed."""
    flags = [*LAYOUTS["packed_dynamic"], "--save_steps", "1"]
    ppo(tmp_path / "cut", ppo_models, *flags, "--max_steps", "1")
    assert train_ppo.main(ppo_argv(tmp_path / "cut", ppo_models, *flags, "--load_checkpoint")) == 0
    assert_same_run(tmp_path / "cut", reference_run)
    assert_same_critic(tmp_path / "cut", reference_run)


# Adam's epsilon for the prefix-sharing comparisons. With the prompt computed once its gradients are summed in
# another order, and transformers' RMSNorm computes in fp32, so the critic's fp32 gradients differ from the
# unshared run's in rounding (with the norm in float64 the two layouts agree to 1e-15: test_rl_prefix_sharing.py).
# Adam normalises each weight's gradient, so rounding in a tiny gradient becomes a visible change in the update:
# after one rollout batch (4 critic steps at lr 5e-3) one critic weight ended 1.11e-5 from the unshared run's at
# eps 1e-6, and 6.7e-6 at eps 1e-4 (the padded layouts above, at 1e-6 over two batches: 4-7e-6).
SHARING_EPS = ["--adam_epsilon", "1e-4"]


@pytest.fixture(scope="module")
def one_batch_run(tmp_path_factory, ppo_models):
    """The reference layout for one rollout batch (4 policy and 4 critic updates)."""
    return ppo(tmp_path_factory.mktemp("ppo_one_batch"), ppo_models, *LAYOUTS["packed_dynamic"], "--max_steps", "1",
               *SHARING_EPS)


def test_prefix_sharing_gives_the_same_actor_and_critic(one_batch_run, tmp_path, ppo_models):
    """--prefix_sharing: the critic's values read at each label's source, the reference and old-policy passes over
    shared units, equal the unshared run (with ``SHARING_EPS``)."""
    run = ppo(tmp_path / "shared", ppo_models, *LAYOUTS["prefix_shared"], "--max_steps", "1", *SHARING_EPS)
    assert_same_run(run, one_batch_run)
    assert_same_critic(run, one_batch_run)
    (metrics,) = read_metrics(run)
    assert metrics["prefix_sharing/token_ratio"] < 0.9


@pytest.mark.slow
def test_two_ranks_with_prefix_sharing_equal_one_unshared_rank(one_batch_run, tmp_path, ppo_models):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_ppo", *ppo_argv(tmp_path / "two", ppo_models, *LAYOUTS["prefix_shared"],
                                                                  "--max_steps", "1", *SHARING_EPS)]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(tmp_path / "two", one_batch_run)
    assert_same_critic(tmp_path / "two", one_batch_run)


def test_train_ppo_without_an_estimator_is_ppo_with_a_critic(ppo_models, tmp_path, monkeypatch):
    """Issue 41: OpenRLHF's train_ppo_ray runs PPO with GAE and a critic unless told otherwise; train_ppo ran
    REINFORCE++ without a critic, so a ported script trained another algorithm. Now the run the driver launches
    (the launch replaced, after every check) is GAE with a critic, which starts from the reward model when there
    is one, else from the policy's own weights (a new value head), as OpenRLHF picks it; train_grpo stays critic-
    and reference-free."""
    from openpack.cli import train_grpo
    from openpack.config import commands
    from openpack.rl.settings import rl_settings
    from openpack.rl.worker import critic_start

    launched = []
    monkeypatch.setattr(commands, "launch", lambda worker, cfg, *args, **kwargs: launched.append(cfg) or 0)
    policy, rm = str(ppo_models / "model"), str(ppo_models / "rm")
    (tmp_path / "reward.py").write_text("def reward(prompts, completions, rows):\n    return [0.0] * len(prompts)\n")
    task = ["--pretrain", policy, "--prompt_data", str(ppo_models / "prompts.jsonl"), "--rollout_backend", "hf",
            "--launcher", "local"]
    assert train_ppo.main([*task, "--reward_pretrain", rm, "--save_path", str(tmp_path / "rm")]) == 0
    assert train_ppo.main([*task, "--reward_fn", f"{tmp_path / 'reward.py'}:reward",
                           "--save_path", str(tmp_path / "rule")]) == 0
    assert train_grpo.main([*task, "--reward_fn", f"{tmp_path / 'reward.py'}:reward",
                            "--save_path", str(tmp_path / "grpo")]) == 0
    with_rm, with_rule, grpo = launched
    for cfg in (with_rm, with_rule):
        settings = rl_settings(cfg)
        assert cfg.rl.advantage_estimator == "gae" and settings.critic and settings.needs_reference
        assert settings.kl_coef == 0.01 and cfg.rl.critic_pretrain is None
    assert critic_start(with_rm.rl, with_rm.model.pretrain) == (rm, "--reward_pretrain")
    assert critic_start(with_rule.rl, with_rule.model.pretrain) == (policy, "--pretrain")
    assert grpo.rl.advantage_estimator == "group_norm"
    assert not rl_settings(grpo).critic and not rl_settings(grpo).needs_reference
