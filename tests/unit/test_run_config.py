"""One config object per run (issue 25): each command's run config has typed sections, builds the same flags, and
reads and writes the same flat config.yaml as the commands did before the sections existed.

``tests/data/configs_before_rl_move/`` holds config.yaml files written by the code at 4e11cdd (before the run
configs and the rl/ layout), one per command, with non-default flags in several sections. A resume compares the
saved config with the new run's (``checkpoint.changed_settings``): a renamed, moved or re-typed key would show
there as a change and refuse the resume. A flag added since appears in the saved-back file at its default (None
or False, the behaviour those runs had, or any value of a setting a resume does not compare, such as the held-out
evaluation's), and a resume does not count it as a change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from openpack.config import dpo, rl, rm, sections, sft
from openpack.distributed.checkpoint import NOT_TRAINING, changed_settings

BEFORE = Path(__file__).parents[1] / "data" / "configs_before_rl_move"
RUN_CONFIGS = {"train_sft": (sft.SFTRunConfig, {}), "train_dpo": (dpo.DPORunConfig, {"aliases": dpo.ALIASES}),
               "train_rm": (rm.RMRunConfig, {}), "train_ppo": (rl.PPORunConfig, {}),
               "train_grpo": (rl.GRPORunConfig, {})}


@pytest.mark.parametrize("command", sorted(RUN_CONFIGS))
def test_a_config_saved_before_the_sections_loads_and_saves_back_unchanged(command, tmp_path):
    run_config, options = RUN_CONFIGS[command]
    saved = BEFORE / f"{command}.yaml"
    cfg = run_config.parse(["--config", str(saved)], f"openpack {command}", "", **options)
    cfg.save(tmp_path / "config.yaml")
    old, new = yaml.safe_load(saved.read_text()), yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert [k for k in new if k in old] == list(old) and all(new[k] == old[k] for k in old)  # same order and values
    added = {k: new[k] for k in new.keys() - old.keys() - NOT_TRAINING}  # training flags added since, at defaults
    assert all(value in (None, False) for value in added.values()), added
    assert changed_settings(old, new) == {}  # what a resume compares


def test_the_check_sees_a_changed_setting(tmp_path):
    """The comparison above can fail: one flag changed on top of the old file shows as a change."""
    saved = BEFORE / "train_sft.yaml"
    cfg = sft.SFTRunConfig.parse(["--config", str(saved), "--max_len", "1024"], "openpack train_sft", "")
    cfg.save(tmp_path / "config.yaml")
    old, new = yaml.safe_load(saved.read_text()), yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert changed_settings(old, new) == {"max_len": (512, 1024)}


def test_sections_are_typed_and_named():
    cfg = rl.GRPORunConfig.parse(["--config", str(BEFORE / "train_grpo.yaml")], "openpack train_grpo", "")
    assert [f.name for f in dataclasses.fields(cfg)] == ["model", "data", "train", "output", "rollout", "rl",
                                                          "launch", "agent", "evaluation"]
    assert isinstance(cfg.rollout, rl.GRPORolloutConfig) and isinstance(cfg.rl, rl.GRPOConfig)
    assert cfg.rollout.n_samples_per_prompt == 8 and cfg.data.label_key == "answer" and cfg.model.pretrain == "org/model"
    assert rl.CONFIGS == (sections.ModelConfig, rl.PromptDataConfig, rl.RLTrainConfig, sections.OutputConfig,
                          rl.RolloutConfig, rl.RLConfig, sections.LaunchConfig, rl.AgentConfig, rl.EvalConfig)
