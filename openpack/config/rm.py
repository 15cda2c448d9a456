"""``openpack train_rm``: Bradley-Terry reward models on chosen/rejected pairs bin-packed under a token cap.

With no ``--pretrain`` and no ``--dataset`` it runs the built-in demo: the
SFT demo model (trained first and cached if absent) gets a value head and
learns to score the addition task's preference pairs; held-out pairwise
accuracy is reported before and after.

This module holds the command's own section (the loss, the head, held-out pairs), its run config and its checks;
the first paragraph above is its ``--help`` description.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openpack.config.preference import PairTrainConfig, PreferenceDataConfig, check_pair_layout
from openpack.config.schema import ConfigError, RunConfig, arg
from openpack.config.sections import (LaunchConfig, ModelConfig, OutputConfig, check_consistency,
                                      check_inputs)
from openpack.core.reward_losses import REWARD_LOSSES, TAKES_MARGIN

DESCRIPTION = __doc__.split("\n\n")[0]
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "rm.yaml"


@dataclass
class RewardConfig:
    loss: str = arg("sigmoid", "pairwise loss: sigmoid, -log sigmoid(r_chosen - r_rejected - margin) (TRL's and "
                    "OpenRLHF's), or logexp, log(1 + exp(r_rejected - r_chosen)) (OpenRLHF's)",
                    choices=sorted(REWARD_LOSSES))
    margin_key: str | None = arg(None, "key of each row's margin, a number chosen must beat rejected by (Llama 2)",
                                 special={None: "no margin"})
    center_rewards_coefficient: float = arg(0.0, "adds this weight of (r_chosen + r_rejected)^2 per pair, pulling "
                                            "rewards to a zero mean (TRL's)", at_least=0)
    value_head_prefix: str = arg("score", "name of the value head's weights in the saved model: score is what "
                                 "AutoModelForSequenceClassification loads; OpenRLHF saves value_head")
    normalize_reward: bool = arg(False, "after training, store the training set's reward mean and std in the saved "
                                 "config; scoring (openpack score, RLHF) then returns (reward - mean) / std")
    eval_dataset: list[str] | None = arg(None, "held-out pairs to report accuracy on (same keys as --dataset)",
                                         special={None: "the --eval_split_ratio share, or none"})
    eval_split_ratio: float = arg(0.0, "share of --dataset rows held out to report accuracy on", at_least=0, below=1,
                                  special={0.0: "none held out"})
    eval_steps: int | None = arg(None, "report held-out accuracy every N steps, besides before and after training",
                                 at_least=1, special={None: "before and after training only"})

    def validate(self):
        if self.margin_key and self.loss not in TAKES_MARGIN:
            raise ConfigError(f"--loss {self.loss} takes no margin: drop --margin_key or use --loss "
                              f"{' or '.join(sorted(TAKES_MARGIN))}")
        if self.eval_dataset and self.eval_split_ratio:
            raise ConfigError("give --eval_dataset or --eval_split_ratio, not both")


@dataclass
class RMTrainConfig(PairTrainConfig):
    learning_rate: float = arg(9e-6, "peak learning rate (AdamW; OpenRLHF's train_rm default)", above=0)


@dataclass
class RMRunConfig(RunConfig):
    """Everything one ``openpack train_rm`` run is told, by section; what ``run_rm`` receives."""

    model: ModelConfig
    data: PreferenceDataConfig
    train: RMTrainConfig
    output: OutputConfig
    rm: RewardConfig
    launch: LaunchConfig


CONFIGS = RMRunConfig.section_classes()  # the flag groups, in the order config.yaml lists them


def check_rm(cfg: RMRunConfig) -> RMRunConfig:
    """The checks across sections, then the model and every data file, before Ray, DeepSpeed or a model load."""
    model_cfg, data_cfg, train_cfg, rm_cfg = cfg.model, cfg.data, cfg.train, cfg.rm
    check_pair_layout(data_cfg, train_cfg, cfg.launch)
    check_consistency(model_cfg, data_cfg.dataset, train_cfg, cfg.launch)
    check_inputs((data_cfg.dataset or []) + (rm_cfg.eval_dataset or []), {"--pretrain": model_cfg.pretrain},
                 prefix_sharing=data_cfg.prefix_sharing)
    return cfg
