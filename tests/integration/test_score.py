"""`openpack score` and RewardScorer: the rewards training computed, normalised on request, one per row, in order.

A tiny reward model is trained for two steps (``train_rm``); scoring the training pairs' sides as rows must
give the rewards the trainer's module gives those pairs, in one process and on a Ray group of 2 actors.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from saved_runs import write_pairs

from openpack.cli import score, train_rm

# --max_len 128: nothing is truncated, so the rows scored are exactly the sequences trained on
TRAIN = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--max_len", "128",
         "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "320", "--launcher", "local"]


@pytest.fixture(scope="module")
def pairs_jsonl(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("score_pairs") / "pairs.jsonl", n=24)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_pretrain, pairs_jsonl):
    save_path = tmp_path_factory.mktemp("rm")
    assert train_rm.main(["--pretrain", tiny_pretrain, "--dataset", pairs_jsonl, "--save_path", str(save_path),
                          *TRAIN, "--normalize_reward"]) == 0
    return save_path / "model"


@pytest.fixture(scope="module")
def rows_jsonl(tmp_path_factory, pairs_jsonl):
    """Each pair's two sides as rows to score: chosen, rejected, chosen, ..."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    with open(path, "w") as f:
        for line in open(pairs_jsonl):
            pair = json.loads(line)
            f.writelines(json.dumps({"prompt": pair["prompt"], "response": pair[side]}) + "\n"
                         for side in ("chosen", "rejected"))
    return path


def trainer_rewards(model_dir, pairs_jsonl):
    """The rewards the training module gives each side of every pair (not normalised), chosen then rejected."""
    from openpack.core.batch import collate_packed
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.data.loading import load_rows
    from openpack.data.preference import tokenize_pairs
    from openpack.models.reward import PackedRewardModel, load_reward_model

    pairs, _ = tokenize_pairs(load_rows([pairs_jsonl]), build_demo_tokenizer(), max_len=10_000)
    module = PackedRewardModel(load_reward_model(str(model_dir)).eval())
    with torch.no_grad():
        return module(collate_packed([seg for i, pair in enumerate(pairs) for seg in pair.segments(i)]))


def read_rewards(path):
    return torch.tensor([json.loads(line)["reward"] for line in open(path)])


def test_scores_are_the_trainers_rewards_normalised(reward_model, pairs_jsonl, rows_jsonl, tmp_path, capsys):
    out = tmp_path / "scored.jsonl"
    assert score.main(["--reward_pretrain", str(reward_model), "--dataset", str(rows_jsonl), "--output", str(out)]) == 0
    assert "24 rewards written" not in capsys.readouterr().out  # 48 rows: both sides of 24 pairs
    config = json.loads((reward_model / "config.json").read_text())
    raw = trainer_rewards(reward_model, pairs_jsonl)
    expected = (raw - config["reward_mean"]) / config["reward_std"]
    torch.testing.assert_close(read_rewards(out), expected, atol=1e-5, rtol=1e-5)
    rows = [json.loads(line) for line in open(out)]
    assert [r["prompt"] for r in rows] == [json.loads(line)["prompt"] for line in open(rows_jsonl)]  # in order
    # the mean and std are the training set's: its rewards, normalised, have mean 0 and std 1 (every pair trained on)
    assert abs(expected.mean().item()) < 1e-4 and abs(expected.std().item() - 1) < 1e-4


def test_the_default_output_sits_next_to_the_input(reward_model, rows_jsonl):
    assert score.main(["--reward_pretrain", str(reward_model), "--dataset", str(rows_jsonl)]) == 0
    assert len(read_rewards(rows_jsonl.with_name("rows.rewards.jsonl"))) == 48


def test_a_model_that_is_no_reward_model_is_named(tiny_pretrain, rows_jsonl, capsys):
    assert score.main(["--reward_pretrain", tiny_pretrain, "--dataset", str(rows_jsonl)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openpack score: --reward_pretrain {tiny_pretrain}: not a reward model: it is "
                          "LlamaForCausalLM"), err


def test_a_row_with_nothing_to_score_is_named(reward_model, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    assert score.main(["--reward_pretrain", str(reward_model), "--dataset", str(data)]) == 2
    assert f"{data}:1: nothing to score" in capsys.readouterr().err


@pytest.mark.slow
def test_a_ray_group_of_two_scores_as_one_process(reward_model, rows_jsonl, tmp_path):
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert score.main(["--reward_pretrain", str(reward_model), "--dataset", str(rows_jsonl), "--output",
                       str(local)]) == 0
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "score", "--reward_pretrain", str(reward_model),
                             "--dataset", str(rows_jsonl), "--output", str(on_ray), "--launcher", "ray",
                             "--reward_num_gpus_per_node", "2", "--num_cpus_per_worker", "1"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert len([line for line in result.stdout.splitlines() if line.startswith("ray: reward ")]) == 2
    torch.testing.assert_close(read_rewards(on_ray), read_rewards(local), atol=1e-5, rtol=1e-5)
