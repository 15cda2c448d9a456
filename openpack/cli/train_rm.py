"""``openpack train_rm``: Bradley-Terry reward models on chosen/rejected pairs bin-packed under a token cap.

With no ``--pretrain`` and no ``--dataset`` it runs the built-in demo: the
SFT demo model (trained first and cached if absent) gets a value head and
learns to score the addition task's preference pairs; held-out pairwise
accuracy is reported before and after.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from openpack.config.schema import ConfigError, RunConfig, arg
from openpack.cli.train_dpo import PreferenceDataConfig, check_prefix_sharing
from openpack.cli.train_sft import (LaunchConfig, ModelConfig, OutputConfig, TrainConfig, announce, check_consistency,
                                    check_inputs, demo_sft_model, with_demo_defaults)
from openpack.cli.train_sft import DataConfig as SFTDataConfig
from openpack.core.reward_losses import REWARD_LOSSES, TAKES_MARGIN
from openpack.orchestration.launch import launch, launched_by_environment

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
class RMRunConfig(RunConfig):
    """Everything one ``openpack train_rm`` run is told, by section; what ``run_rm`` receives."""

    model: ModelConfig
    data: PreferenceDataConfig
    train: TrainConfig
    output: OutputConfig
    rm: RewardConfig
    launch: LaunchConfig


CONFIGS = RMRunConfig.section_classes()  # the flag groups, in the order config.yaml lists them


def demo_rm_model(launch_cfg: LaunchConfig, seed: int) -> Path:
    """The reward model the PPO demo scores with: this command's demo with ``--normalize_reward`` and that
    ``--seed``, cached like the SFT demo model (a folder named by a digest of the recipes and the code)."""
    from openpack.cli.train_sft import DEMO_CONFIG as SFT_DEMO_CONFIG
    from openpack.trainers import demo

    cache = demo.cache_root() / f"demo_rm-{demo.code_key(DEMO_CONFIG, SFT_DEMO_CONFIG)}-seed{seed}"
    if not (cache / "model" / "config.json").exists():
        print(f"openpack: training the reward-model demo first (cached in {cache})")
        launch_flags = ["--launcher", launch_cfg.launcher] + (["--ray_address", launch_cfg.ray_address]
                                                              if launch_cfg.ray_address else [])
        code = main(["--save_path", str(cache), "--seed", str(seed), "--normalize_reward", *launch_flags])
        if code != 0:  # the stage said why (or was stopped: 130, 143); its exit code is the command's, no traceback
            raise SystemExit(code)
    return cache / "model"


def main(argv: list[str] | None = None) -> int:
    from openpack.data.loading import DataError
    from openpack.models.loading import ModelLoadError

    argv, demo_notice = with_demo_defaults(sys.argv[1:] if argv is None else list(argv), "train_rm", DEMO_CONFIG)
    try:
        cfg = RMRunConfig.parse(argv, "openpack train_rm", __doc__.split("\n\n")[0])
        model_cfg, data_cfg, train_cfg, out_cfg, rm_cfg, launch_cfg = cfg.sections()
        check_consistency(model_cfg, SFTDataConfig(dataset=data_cfg.dataset, max_len=1), train_cfg, launch_cfg)
        if train_cfg.use_dynamic_batch and 2 * data_cfg.max_len > train_cfg.max_tokens_per_gpu:
            raise ConfigError(
                f"a pair is up to 2 x --max_len = {2 * data_cfg.max_len} tokens, more than --max_tokens_per_gpu "
                f"{train_cfg.max_tokens_per_gpu}; lower --max_len or raise --max_tokens_per_gpu"
            )
        check_prefix_sharing(data_cfg, train_cfg)
        check_inputs((data_cfg.dataset or []) + (rm_cfg.eval_dataset or []), {"--pretrain": model_cfg.pretrain},
                     prefix_sharing=data_cfg.prefix_sharing)
    except (ConfigError, DataError, ModelLoadError) as err:
        print(f"openpack train_rm: {err}", file=sys.stderr)
        return 2
    announce("train_rm", cfg, demo_notice)
    from openpack.distributed.save_path import CheckpointError, own_save_path
    from openpack.trainers.rm_worker import plan_rm, run_rm

    try:
        with own_save_path(out_cfg, launched_by_environment()):  # lock; refuse a taken --save_path
            demo_model = demo_sft_model(launch_cfg, train_cfg.seed) if model_cfg.pretrain is None else None
            planner = functools.partial(plan_rm, cfg, demo_model=demo_model)
            return launch(run_rm, cfg, {"demo_model": demo_model, "save_config": cfg.save}, planner)
    except (DataError, ModelLoadError, CheckpointError) as err:
        print(f"openpack train_rm: {err}", file=sys.stderr)
        return 2
