"""The held-out evaluation of train_grpo end to end on CPU (issue 42, item 4): HF rollouts, --launcher local, the tiny
policy of test_train_ppo.py.

The reward scripts what the evaluation sees: on a held-out row (its ``held_out`` column) the first of each prompt's
4 samples scores ``VALUES[e]`` at the e-th evaluation and the other three score 0, so every evaluation must log
pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1 and a mean reward of ``VALUES[e]`` / 4, and the metric
rises to its best after rollout batch 2, then falls: best/ must hold the policy of rollout batch 2 (its checkpoint's
weights, not the final model's). Training rows get test_train_ppo.py's reward.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from openpack.cli import train_grpo

from saved_runs import read_metrics

VALUES = [0.1, 0.3, 0.9, 0.5]  # before training, after rollout batches 1 and 2, and after training (batch 3)
REWARD = f'''
VALUES = {VALUES}
evaluations = []


def reward(prompts, completions, rows):
    if not rows[0].get("held_out"):
        return [c.count('a') + 0.5 * c.count('e') - 0.1 * len(c) for c in completions]
    value = VALUES[len(evaluations)]
    evaluations.append(value)
    return [value if i % 4 == 0 else 0.0 for i in range(len(completions))]
'''
COMMON = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
          "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
          "--rollout_backend", "hf", "--launcher", "local", "--packing_samples", "--use_dynamic_batch",
          "--max_tokens_per_gpu", "256"]


def held_out_prompts(path, n=3):
    with open(path, "w") as f:
        for word in ["bead", "cafe", "jig"][:n]:
            f.write(json.dumps({"prompt": f"sort: {word}\n", "label": "".join(sorted(word)), "held_out": True}) + "\n")
    return str(path)


def test_evaluations_every_n_steps_and_the_best_checkpoint(tmp_path, rl_model):
    (tmp_path / "reward.py").write_text(REWARD)
    save = tmp_path / "run"
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{tmp_path / 'reward.py'}:reward", "--save_path", str(save), *COMMON,
            "--max_steps", "3", "--save_steps", "2",
            "--eval_prompt_data", held_out_prompts(tmp_path / "held_out.jsonl"), "--eval_steps", "1",
            "--eval_n_samples_per_prompt", "4", "--eval_temperature", "1.0",
            "--best_metric_key", "eval/reward/mean_reward"]
    assert train_grpo.main(argv) == 0

    evaluations = [m for m in read_metrics(save) if "eval/reward/pass@1" in m]
    assert [m["step"] for m in evaluations] == [0, 1, 2, 3]  # before, every rollout batch, after
    for m, value in zip(evaluations, VALUES):
        assert m["eval/reward/pass@1"] == pytest.approx(0.25)
        assert m["eval/reward/pass@2"] == pytest.approx(0.5)
        assert m["eval/reward/pass@4"] == pytest.approx(1.0)
        assert m["eval/reward/mean_reward"] == pytest.approx(value / 4)
        assert 0 < m["eval/response_length/mean"] <= 8
    assert all("eval/reward/pass@1" not in m for m in read_metrics(save) if "loss" in m)  # lines of their own

    record = json.loads((save / "best" / "openpack_best.json").read_text())
    assert record["step"] == 2 and record["metric"] == "eval/reward/mean_reward"
    assert record["value"] == pytest.approx(VALUES[2] / 4)
    best = load_file(save / "best" / "model.safetensors")
    at_2 = load_file(save / "checkpoints" / "global_step2" / "hf_model" / "model.safetensors")
    at_3 = load_file(save / "model" / "model.safetensors")
    assert best.keys() == at_2.keys()
    assert all(torch.equal(best[k], at_2[k]) for k in best)
    assert any(not torch.equal(best[k], at_3[k]) for k in best)  # batch 3 trained on: other weights


ENV = '''
class TwoTurns:
    async def reset(self, sample):
        self.turn = 0
        return sample["prompt"]

    async def step(self, action):
        self.turn += 1
        done = self.turn == 2
        return {"observation": "" if done else " again: ", "reward": float(action.count("e") > 0) if done else 0.0,
                "done": done}
'''


def test_agent_runs_evaluate_episodes_through_the_engines(tmp_path, rl_model, capsys):
    """Episodes of the run's environment, 2 per held-out prompt at temperature 1: pass@1 is the share of successes
    (eval_success, as logged before pass@k), pass@2 at least that, before training and after."""
    (tmp_path / "env.py").write_text(ENV)
    save = tmp_path / "agent"
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--env_file", str(tmp_path / "env.py"), "--save_path", str(save), *COMMON, "--max_steps", "1",
            "--eval_prompt_data", held_out_prompts(tmp_path / "held_out.jsonl"), "--eval_n_samples_per_prompt", "2",
            "--eval_temperature", "1.0"]
    assert train_grpo.main(argv) == 0
    evaluations = [m for m in read_metrics(save) if "eval_success" in m]
    assert [m["step"] for m in evaluations] == [0, 1]
    for m in evaluations:
        assert m["eval/episode/pass@1"] == pytest.approx(m["eval_success"])
        assert m["eval/episode/pass@1"] <= m["eval/episode/pass@2"] <= 1
        assert m["eval_turns"] > 1  # two turns each, unless the token budget ended one
    out = capsys.readouterr().out
    assert "held-out before training: success" in out and "of 6 episodes (temperature 1)" in out
