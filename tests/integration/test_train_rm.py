"""openpack train_rm end to end on CPU: packing is exact, the export scores as the trainer does, bad input is named.

Two optimizer steps of 8 pairs with per-pair margins and centering: every layout and world size must give
the same per-step loss, grad norm and final weights to 1e-5 in fp32, because the loss is the mean over the
step's pairs. (The first-step loss and gradient against TRL's RewardTrainer: test_trl_rm_oracle.py.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from saved_runs import assert_same_run, read_metrics, write_pairs

from openpack.cli import train_rm
from openpack.distributed.process import free_port
from hang_guard import HANG_S

# --adam_epsilon 1e-6: as in test_train_dpo.py, weights are compared after Adam, which divides a float-noise
# gradient by eps.
COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
          "--lr_scheduler", "constant", "--max_len", "48", "--seed", "1", "--max_norm", "100",
          "--margin_key", "margin", "--center_rewards_coefficient", "0.01", "--adam_epsilon", "1e-6",
          "--launcher", "local"]
LAYOUTS = {
    "packed_dynamic": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "160"],
    "padded_8x1": ["--micro_train_batch_size", "1"],
    "padded_1x8": ["--micro_train_batch_size", "8"],
}


@pytest.fixture(scope="module")
def rm_jsonl(tmp_path_factory):
    """The DPO test pairs with a margin each (some negative, some zero)."""
    path = write_pairs(tmp_path_factory.mktemp("rm_pairs") / "pairs.jsonl")
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        f.writelines(json.dumps({**row, "margin": (i % 5 - 2) / 4}) + "\n" for i, row in enumerate(rows))
    return path


def rm(save_path, pretrain, dataset, *flags):
    argv = ["--pretrain", pretrain, "--dataset", dataset, "--save_path", str(save_path), *COMMON, *flags]
    assert train_rm.main(argv) == 0
    return save_path


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_pretrain, rm_jsonl):
    return rm(tmp_path_factory.mktemp("rm_ref"), tiny_pretrain, rm_jsonl, *LAYOUTS["packed_dynamic"])


@pytest.mark.parametrize("layout", ["padded_8x1", "padded_1x8"])
def test_layouts_give_the_same_steps(layout, reference_run, tmp_path, tiny_pretrain, rm_jsonl):
    assert_same_run(rm(tmp_path / layout, tiny_pretrain, rm_jsonl, *LAYOUTS[layout]), reference_run)


def test_prefix_sharing_gives_the_same_steps(reference_run, tmp_path, tiny_pretrain, rm_jsonl):
    """One group prompt | chosen | rejected per pair, rewards read at each response's last token: the same run."""
    shared = rm(tmp_path / "shared", tiny_pretrain, rm_jsonl, *LAYOUTS["packed_dynamic"], "--prefix_sharing")
    assert_same_run(shared, reference_run)
    assert all(s["tokens"] < u["tokens"] for s, u in zip(read_metrics(shared), read_metrics(reference_run)))


@pytest.mark.slow
def test_two_ranks_equal_one_rank(reference_run, tmp_path, tiny_pretrain, rm_jsonl):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_rm", "--pretrain", tiny_pretrain, "--dataset", rm_jsonl,
           "--save_path", str(tmp_path / "two"), *COMMON[:-2], *LAYOUTS["packed_dynamic"]]
    assert COMMON[-2:] == ["--launcher", "local"]  # left out: under torchrun each process is a rank
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(tmp_path / "two", reference_run)


def test_metrics_are_named_as_trl_names_them(reference_run):
    for m in read_metrics(reference_run):
        assert m["pairs"] == 8 and m["micro_batches"] < 8 and 0 < m["packing_efficiency"] <= 1
        for key in ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "tokens_per_s"):
            assert key in m, key
        assert m["margin"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"], abs=1e-6)
        assert 0 <= m["accuracy"] <= 1


def test_the_export_is_a_sequence_classifier_that_scores_as_the_trainer(reference_run, rm_jsonl):
    """AutoModelForSequenceClassification loads the saved folder; its batched, padded scores equal openpack's
    packed ones (the reward read at each sequence's last token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from openpack.core.batch import Segment, collate_packed
    from openpack.models.reward import PackedRewardModel, load_reward_model

    folder = reference_run / "model"
    exported = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert exported.config.num_labels == 1 and exported.config.architectures == ["LlamaForSequenceClassification"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in open(rm_jsonl)][:6]
    texts = [row["prompt"] + row[side] + tokenizer.eos_token for row in rows for side in ("chosen", "rejected")]
    encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        hf = exported(**encoded).logits[:, 0]
        ours = PackedRewardModel(load_reward_model(str(folder)).eval())(collate_packed(
            [Segment(ids, [False] * len(ids), i) for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)
                                                                         ["input_ids"])]))
    torch.testing.assert_close(ours, hf, atol=1e-5, rtol=1e-5)
    assert hf.std() > 0.01  # a trained head, not a constant


def test_normalize_reward_stores_mean_and_std(tmp_path, tiny_pretrain, rm_jsonl):
    run = rm(tmp_path / "norm", tiny_pretrain, rm_jsonl, *LAYOUTS["packed_dynamic"], "--normalize_reward")
    config = json.loads((run / "model" / "config.json").read_text())
    assert config["normalize_reward"] is True and config["reward_std"] > 0
    assert isinstance(config["reward_mean"], float)


def test_held_out_accuracy_on_a_split_and_another_head_name(tmp_path, tiny_pretrain, rm_jsonl):
    """--eval_split_ratio holds rows out (reported before, every --eval_steps and after); --value_head_prefix
    value_head writes OpenRLHF's head name, and reads it back."""
    from safetensors.torch import load_file

    from openpack.models.reward import load_reward_model

    run = rm(tmp_path / "split", tiny_pretrain, rm_jsonl, *LAYOUTS["packed_dynamic"], "--eval_split_ratio", "0.25",
             "--eval_steps", "1", "--value_head_prefix", "value_head")
    evals = [m for m in read_metrics(run) if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]  # before, every step but the last, after
    assert all(0 <= m["eval_accuracy"] <= 1 for m in evals)
    weights = load_file(run / "model" / "model.safetensors")
    assert "value_head.weight" in weights and "score.weight" not in weights
    model = load_reward_model(str(run / "model"), value_head_prefix="value_head")
    torch.testing.assert_close(model.score.weight, weights["value_head.weight"])


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("row,message", [
    ({"prompt": "ab", "chosen": "ba", "rejected": "ba", "margin": 1}, "pairs.jsonl:1: 'chosen' and 'rejected'"),
    ({"prompt": "ab", "chosen": "", "rejected": "bb", "margin": 1}, "pairs.jsonl:1: 'chosen'"),
    ({"prompt": "ab", "chosen": "ba", "rejected": "bb", "margin": "high"}, "'margin' (--margin_key) is 'high'"),
    ({"prompt": "ab", "chosen": "ba", "rejected": "bb"}, "no key 'margin' (--margin_key"),
])
def test_bad_pairs_are_named_or_skipped(row, message, tmp_path, tiny_pretrain, capsys, caplog):
    good = {"prompt": "ab", "chosen": "ba", "rejected": "bb", "margin": 0.5}
    data = write_rows(tmp_path / "pairs.jsonl", [row] + [good] * 8)
    argv = ["--pretrain", tiny_pretrain, "--dataset", data, *COMMON, *LAYOUTS["packed_dynamic"], "--max_steps", "1"]
    assert train_rm.main([*argv, "--save_path", str(tmp_path / "a")]) == 2
    assert message in capsys.readouterr().err
    with caplog.at_level("INFO", logger="openpack"):
        assert train_rm.main([*argv, "--save_path", str(tmp_path / "b"), "--skip_bad_samples"]) == 0
    assert "; skipped: 1 " in caplog.text, caplog.text


def test_flag_checks(tmp_path, tiny_pretrain, rm_jsonl, capsys):
    argv = ["--pretrain", tiny_pretrain, "--dataset", rm_jsonl, "--save_path", str(tmp_path)]
    assert train_rm.main([*argv, "--loss", "logexp", "--margin_key", "margin"]) == 2
    assert "--loss logexp takes no margin" in capsys.readouterr().err
    assert train_rm.main([*argv, "--eval_dataset", rm_jsonl, "--eval_split_ratio", "0.1"]) == 2
    assert "not both" in capsys.readouterr().err
    assert train_rm.main([*argv, "--prefix_sharing"]) == 2
    assert "add --packing_samples" in capsys.readouterr().err
