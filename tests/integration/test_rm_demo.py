"""`openpack train_rm` with no arguments: the built-in reward-model demo, from the cached SFT demo model.

The SFT demo model gets a new value head and learns 8,960 pairs of the addition task: the bare right answer over
its wordy form or a plausible wrong one (off by one, digits swapped, carry dropped). What it learns, scored here on
all 1,022 held-out pairs by kind of rejected answer (docs/rm.md, "The built-in demo"):

- bare over wordy, the preference in no SFT row: 100% in every run measured;
- over a swapped or carry-less sum: 97.1-100% at the default learning rate;
- over a sum off by one: 53.9-100% (24.5% for right + 1 with seed 1). The tiny model must recompute the last digit
  at the end of the answer to tell 47 from 46, and whether it learns to depends on rounding: one CPU rank running
  ZeRO-2 as stage 0 (2026-11-27, the same update up to rounding) took seed 42 from 96.2% to 87.4% overall, 124 of
  its 129 lost pairs off by one. So the overall accuracy (85.2-99.6% over the runs measured) is not asserted.

The SFT demo model comes from this session's fresh cache (the DPO demo test, run first, trains it for seed 42), and
the export must load as a sequence classifier.
"""

import pytest
import torch
import yaml
from saved_runs import read_metrics

from openpack.config.commands import demo_rm_model
from openpack.config.sections import LaunchConfig


def accuracy_by_kind(model_path) -> dict[str, tuple[int, int]]:
    """(pairs ranked right, pairs) on the held-out pairs, scored by the exported model, by what the rejected answer
    is."""
    from transformers import AutoModelForSequenceClassification

    from openpack.data.demo_task import demo_preference_pairs
    from openpack.data.loading import Rows
    from openpack.data.preference import tokenize_pairs
    from openpack.models.loading import load_tokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    rows = demo_preference_pairs("test", 1022)
    tokenizer = load_tokenizer(str(model_path))  # demo_rm_model gives a Path; the loader takes a str
    pairs, _ = tokenize_pairs(Rows(rows, [f"held-out pair {i}" for i in range(len(rows))]), tokenizer)
    hits: dict[str, list[bool]] = {"wordy": [], "off by one": [], "other mistake": []}
    with torch.no_grad():
        for row, pair in zip(rows, pairs):
            chosen, rejected = (model(torch.tensor([pair.prompt + answer]), use_cache=False).logits[0, 0]
                                for answer in (pair.chosen, pair.rejected))
            right = int(row["chosen"])
            kind = ("wordy" if row["rejected"].startswith("it is") else
                    "off by one" if abs(int(row["rejected"]) - right) == 1 else "other mistake")
            hits[kind].append(bool(chosen > rejected))
    return {kind: (sum(h), len(h)) for kind, h in hits.items()}


@pytest.mark.slow
def test_rm_demo_learns_the_preferences():
    """The demo as the PPO demo trains and caches it (`openpack train_rm --normalize_reward`, seed 42): whichever of
    this test and tests/integration/test_ppo_demo.py runs first trains it once for both."""
    model = demo_rm_model(LaunchConfig(launcher="local"), 42)
    run = yaml.safe_load((model.parent / "config.yaml").read_text())
    assert run["pretrain"] is None and run["dataset"] is None and run["normalize_reward"]  # the built-in demo
    evals = [m for m in read_metrics(model.parent) if "eval_accuracy" in m]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and before["eval_accuracy"] <= 0.7, before  # a random head: near chance
    assert after["eval_accuracy"] >= before["eval_accuracy"] + 0.15, (before, after)
    by_kind = accuracy_by_kind(model)
    assert sum(n for _, n in by_kind.values()) == 1022
    assert abs(sum(k for k, _ in by_kind.values()) / 1022 - after["eval_accuracy"]) < 1e-6, (by_kind, after)
    assert by_kind["wordy"][0] == by_kind["wordy"][1], by_kind  # every one
    assert by_kind["other mistake"][0] >= 0.9 * by_kind["other mistake"][1], by_kind
    from transformers import AutoModelForSequenceClassification

    config = AutoModelForSequenceClassification.from_pretrained(model).config
    assert config.num_labels == 1 and config.normalize_reward and config.reward_std > 0
