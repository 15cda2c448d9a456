"""`openpack score` and RewardScorer: the rewards training computed, normalised on request, one per row, in order.

A tiny reward model is trained for two steps (``train_rm``); scoring the training pairs' sides as rows must
give the rewards the trainer's module gives those pairs, in one process and on a Ray group of 2 actors.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from saved_runs import write_pairs

from openpack.cli import score, train_rm
from hang_guard import HANG_S

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


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def rows_jsonl(tmp_path_factory, pairs_jsonl):
    """Each pair's two sides as rows to score: chosen, rejected, chosen, ..."""
    return write_jsonl(tmp_path_factory.mktemp("rows") / "rows.jsonl",
                       [{"prompt": pair["prompt"], "response": pair[side]}
                        for pair in read_jsonl(pairs_jsonl) for side in ("chosen", "rejected")])


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
                          "LlamaForCausalLM with 2 label(s)"), err  # transformers' default: config.json has none


def test_a_row_with_nothing_to_score_is_named(reward_model, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    assert score.main(["--reward_pretrain", str(reward_model), "--dataset", str(data)]) == 2
    assert f"{data}:1: nothing to score" in capsys.readouterr().err


@pytest.fixture(scope="module")
def messages_jsonl(tmp_path_factory, rows_jsonl):
    """The rows of ``rows_jsonl`` as conversations: the prompt a user turn, the response an assistant turn."""
    return write_jsonl(tmp_path_factory.mktemp("conversations") / "conversations.jsonl",
                       [{"messages": [{"role": "user", "content": row["prompt"]},
                                      {"role": "assistant", "content": row["response"]}]}
                        for row in read_jsonl(rows_jsonl)])


def score_rows(model, dataset, out, *flags) -> int:
    return score.main(["--reward_pretrain", str(model), "--dataset", str(dataset), "--output", str(out), *flags])


CHAT_WARNING = "text rows scored as raw text, but the reward model's tokenizer has a chat template"


def test_apply_chat_template_scores_text_rows_as_the_same_conversations(reward_model, rows_jsonl, messages_jsonl,
                                                                         tmp_path, capsys):
    """Issue 23: text rows sent to a chat-trained reward model were scored as raw text (mean 9.84 against -0.15
    for the same pairs as messages). With the flag they are the conversations' token ids exactly, so their rewards
    are the same floats."""
    from openpack.data.loading import load_rows
    from openpack.data.scoring import tokenize_for_scoring
    from openpack.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(reward_model))
    templated, raw_left = tokenize_for_scoring(load_rows([str(rows_jsonl)]), tokenizer, apply_chat_template=True)
    conversations, _ = tokenize_for_scoring(load_rows([str(messages_jsonl)]), tokenizer)
    raw, raw_rows = tokenize_for_scoring(load_rows([str(rows_jsonl)]), tokenizer)
    assert templated == conversations and raw_left == 0
    assert raw != templated and raw_rows == 48

    assert score_rows(reward_model, rows_jsonl, tmp_path / "text.jsonl", "--apply_chat_template") == 0
    assert CHAT_WARNING not in capsys.readouterr().err
    assert score_rows(reward_model, messages_jsonl, tmp_path / "messages.jsonl") == 0
    assert CHAT_WARNING not in capsys.readouterr().err
    assert torch.equal(read_rewards(tmp_path / "text.jsonl"), read_rewards(tmp_path / "messages.jsonl"))


def test_text_rows_for_a_chat_tokenizer_warn_in_one_line_naming_the_flag(reward_model, rows_jsonl, tmp_path, capsys):
    """The demo tokenizer has a chat template; the model's run recorded apply_chat_template: false, so nothing
    decides for the user: the rows are scored raw, with the warning. --no_apply_chat_template is a choice: no
    warning."""
    assert score_rows(reward_model, rows_jsonl, tmp_path / "raw.jsonl") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if CHAT_WARNING in line]
    assert len(warnings) == 1 and warnings[0].startswith("openpack score: warning: 48 text rows")
    assert "pass --apply_chat_template" in warnings[0]
    assert score_rows(reward_model, rows_jsonl, tmp_path / "chosen_raw.jsonl", "--no_apply_chat_template") == 0
    assert CHAT_WARNING not in capsys.readouterr().err
    assert torch.equal(read_rewards(tmp_path / "raw.jsonl"), read_rewards(tmp_path / "chosen_raw.jsonl"))


def test_a_run_recorded_with_apply_chat_template_makes_it_the_default_and_says_so(reward_model, rows_jsonl,
                                                                                   messages_jsonl, tmp_path, capsys):
    """train_rm --apply_chat_template records it in <save_path>/config.yaml beside <save_path>/model; scoring that
    model templates text rows unless the user's flag says otherwise."""
    run = tmp_path / "rm"
    shutil.copytree(reward_model, run / "model")
    (run / "config.yaml").write_text((reward_model.parent / "config.yaml").read_text().replace(
        "apply_chat_template: false", "apply_chat_template: true"))
    assert score_rows(run / "model", rows_jsonl, tmp_path / "auto.jsonl") == 0
    captured = capsys.readouterr()
    assert f"openpack score: --apply_chat_template, as {run / 'config.yaml'} records" in captured.out
    assert CHAT_WARNING not in captured.err
    assert score_rows(reward_model, messages_jsonl, tmp_path / "messages.jsonl") == 0
    assert torch.equal(read_rewards(tmp_path / "auto.jsonl"), read_rewards(tmp_path / "messages.jsonl"))

    capsys.readouterr()
    assert score_rows(run / "model", rows_jsonl, tmp_path / "raw.jsonl", "--no_apply_chat_template") == 0
    assert "--apply_chat_template, as" not in capsys.readouterr().out
    assert not torch.equal(read_rewards(tmp_path / "raw.jsonl"), read_rewards(tmp_path / "auto.jsonl"))


@pytest.mark.slow
def test_a_ray_group_of_two_scores_as_one_process(reward_model, rows_jsonl, tmp_path):
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert score.main(["--reward_pretrain", str(reward_model), "--dataset", str(rows_jsonl), "--output",
                       str(local)]) == 0
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "score", "--reward_pretrain", str(reward_model),
                             "--dataset", str(rows_jsonl), "--output", str(on_ray), "--launcher", "ray",
                             "--reward_num_gpus_per_node", "2", "--num_cpus_per_worker", "1"],
                            capture_output=True, text=True, timeout=HANG_S,
                            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert len([line for line in result.stdout.splitlines() if line.startswith("ray: reward ")]) == 2
    torch.testing.assert_close(read_rewards(on_ray), read_rewards(local), atol=1e-5, rtol=1e-5)
