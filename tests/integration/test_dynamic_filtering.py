"""DAPO's dynamic sampling (`--dynamic_filtering`): groups whose completions all score the same are dropped and
replaced by groups of other prompts, the number dropped is a metric, and the replacements are drawn so that a
resumed run draws the same.

GRPO on the tiny policy with HF rollouts: 4 prompts x 4 completions per rollout batch, up to 8 new tokens. With
the reward "the completion has an 'a'", a random policy gives many groups of all-0 rewards.
"""

import pytest

from openpack.cli import train_grpo

from saved_runs import assert_same_run, read_metrics

COMMON = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8",
          "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
          "--max_steps", "3", "--rollout_backend", "hf", "--launcher", "local", "--dynamic_filtering",
          "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96",
          "--adam_epsilon", "1e-6",  # as test_train_ppo.py: at 1e-8 Adam blows rounding in a tiny gradient up
          # a constant rate: the resume test's first run plans 2 of the 3 steps, and the default schedule (OpenRLHF's
          # cosine with warm-up, issue 41) would give its step 2 another rate than the uninterrupted run's
          "--lr_scheduler", "constant", "--lr_warmup_ratio", "0"]
REWARDS = {
    "has_a": "def reward(prompts, completions, rows):\n    return [float('a' in c) for c in completions]\n",
    "constant": "def reward(prompts, completions, rows):\n    return [1.0 for c in completions]\n",
}


def grpo(save_path, ppo_models, reward: str, *flags):
    file = ppo_models / f"{reward}.py"
    file.write_text(REWARDS[reward])
    argv = ["--pretrain", str(ppo_models / "model"), "--prompt_data", str(ppo_models / "prompts.jsonl"),
            "--reward_fn", f"{file}:reward", "--save_path", str(save_path), *COMMON, *flags]
    assert train_grpo.main(argv) == 0
    return save_path


@pytest.fixture(scope="module")
def filtered_run(tmp_path_factory, ppo_models):
    return grpo(tmp_path_factory.mktemp("filtered"), ppo_models, "has_a", "--no_prefix_sharing")


def test_uniform_groups_are_dropped_and_replaced(filtered_run):
    metrics = read_metrics(filtered_run)
    assert sum(m["dynamic_filtering/dropped_groups"] for m in metrics) > 0  # the random policy makes some
    for m in metrics:
        assert m["dynamic_filtering/short_groups"] == 0  # each batch was refilled to 4 groups that disagree
        assert m["dynamic_filtering/kept_groups"] == 4
        assert m["reward_std"] > 0 and 0 < m["reward"] < 1
        assert m["optimizer_steps"] == 2  # a full batch: 16 completions in steps of 8


def test_a_reward_that_never_differs_keeps_nothing_and_skips_the_update(tmp_path, ppo_models):
    """Every group of every round is uniform: 4 groups dropped in the batch and in each of the 4 refill rounds,
    none kept, and the step's update is skipped (every advantage would be 0). --dynamic_filtering_max_empty_steps 4
    lets the 3 steps run; test_rl_bad_input.py has the default stopping the run."""
    for m in read_metrics(grpo(tmp_path, ppo_models, "constant", "--dynamic_filtering_max_empty_steps", "4")):
        assert m["dynamic_filtering/dropped_groups"] == 4 * 5
        assert m["dynamic_filtering/refill_rounds"] == 4
        assert m["dynamic_filtering/kept_groups"] == 0
        assert m["optimizer_steps"] == 0 and "policy_loss" not in m


def test_resumed_run_draws_the_same_replacements(filtered_run, tmp_path, ppo_models):
    grpo(tmp_path, ppo_models, "has_a", "--save_steps", "1", "--max_steps", "2", "--no_prefix_sharing")
    grpo(tmp_path, ppo_models, "has_a", "--load_checkpoint", "--no_prefix_sharing")
    assert_same_run(tmp_path, filtered_run)
    for x, y in zip(read_metrics(tmp_path), read_metrics(filtered_run)):
        assert x["dynamic_filtering/dropped_groups"] == y["dynamic_filtering/dropped_groups"]


def test_prefix_sharing_trains_the_same_filtered_batches(filtered_run, tmp_path, ppo_models):
    """The kept and refilled groups (concatenated from several generation rounds) laid out per prompt with
    --prefix_sharing (the default under --packing_samples --use_dynamic_batch): the same run."""
    run = grpo(tmp_path, ppo_models, "has_a")
    assert_same_run(run, filtered_run)
    for m in read_metrics(run):
        assert m["prefix_sharing/token_ratio"] < 0.9
