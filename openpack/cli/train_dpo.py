"""``openpack train_dpo``: preference training with chosen/rejected pairs bin-packed under a token cap.

With no ``--pretrain`` and no ``--dataset`` it runs the built-in demo: the
SFT demo model (trained first and cached if absent) learns from preference
pairs of the addition task, and held-out preference accuracy and exact match
are reported before and after.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from openpack.cli.config import ConfigError, arg, parse_config
from openpack.cli.train_sft import DataConfig as SFTDataConfig
from openpack.cli.train_sft import (DatasetConfig, LaunchConfig, ModelConfig, OutputConfig, TrainConfig,
                                    check_consistency, launch, with_demo_defaults)

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "dpo.yaml"


@dataclass
class PreferenceDataConfig(DatasetConfig):
    prompt_key: str = arg("prompt", "key of the prompt in each row")
    chosen_key: str = arg("chosen", "key of the preferred response")
    rejected_key: str = arg("rejected", "key of the dispreferred response")


@dataclass
class DPOConfig:
    ref_pretrain: str | None = arg(None, "reference model; default: --pretrain")
    beta: float = arg(0.1, "strength of the KL penalty towards the reference")
    loss_type: list[str] = arg(["sigmoid"], "preference losses (see docs/dpo.md); several are summed with --loss_weights")
    loss_weights: list[float] | None = arg(None, "weight of each --loss_type; default 1 each")
    label_smoothing: float = arg(0.0, "cDPO / robust DPO: assumed share of flipped preference labels")
    nll_loss_coef: float = arg(0.0, "adds this weight of the chosen responses' NLL (the sft loss)")
    simpo_gamma: float = arg(0.5, "SimPO target reward margin")
    ref_offload: bool = arg(False, "keep the reference model's parameters on the CPU (ZeRO-3)")
    ref_logps_cache: str | None = arg(None, "file of precomputed reference log-probs: computed once, reused, reference freed")

    def validate(self):
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ConfigError(f"--loss_weights has {len(self.loss_weights)} values for {len(self.loss_type)} --loss_type")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


CONFIGS = (ModelConfig, PreferenceDataConfig, TrainConfig, OutputConfig, DPOConfig, LaunchConfig)
ALIASES = {"--ipo": ("loss_type", ["ipo"])}


def demo_sft_model() -> Path:
    """The SFT demo model DPO starts from: the `openpack train_sft` demo (about 75 s on 2 CPU cores), cached."""
    from openpack.cli import train_sft
    from openpack.trainers import demo

    # Named by the SFT demo recipe, so a changed recipe never reuses a model trained by an old one.
    recipe_text = train_sft.DEMO_CONFIG.read_bytes() + repr((demo.DEMO_MODEL, demo.TRAIN_SAMPLES)).encode()
    recipe = hashlib.sha256(recipe_text).hexdigest()[:12]
    cache = Path(os.environ.get("OPENPACK_CACHE", Path.home() / ".cache" / "openpack")) / f"demo_sft-{recipe}"
    if not (cache / "model" / "config.json").exists():
        print(f"openpack train_dpo: training the SFT demo model first (cached in {cache})")
        if train_sft.main(["--save_path", str(cache)]) != 0:
            raise RuntimeError("the SFT demo run failed; see its output above")
    return cache / "model"


def main(argv: list[str] | None = None) -> int:
    argv = with_demo_defaults(sys.argv[1:] if argv is None else list(argv), "train_dpo", DEMO_CONFIG)
    try:
        configs = parse_config(argv, "openpack train_dpo", __doc__.split("\n\n")[0], *CONFIGS, aliases=ALIASES)
        model_cfg, data_cfg, train_cfg, out_cfg, dpo_cfg, _ = configs
        check_consistency(model_cfg, SFTDataConfig(dataset=data_cfg.dataset, max_len=1), train_cfg)
        if train_cfg.use_dynamic_batch and 2 * data_cfg.max_len > train_cfg.max_tokens_per_gpu:
            raise ConfigError(
                f"a pair is up to 2 x --max_len = {2 * data_cfg.max_len} tokens, more than --max_tokens_per_gpu "
                f"{train_cfg.max_tokens_per_gpu}; lower --max_len or raise --max_tokens_per_gpu"
            )
        if dpo_cfg.ref_offload and model_cfg.zero_stage != 3:
            raise ConfigError("--ref_offload needs --zero_stage 3 (the reference's parameters are offloaded by ZeRO-3)")
    except ConfigError as err:
        print(f"openpack train_dpo: {err}", file=sys.stderr)
        return 2
    from openpack.data.loading import DataError
    from openpack.models.loading import ModelLoadError
    from openpack.trainers.dpo_worker import run_dpo

    demo_model = demo_sft_model() if model_cfg.pretrain is None else None
    try:
        return launch(run_dpo, configs[:-1], {"demo_model": demo_model}, configs)
    except (DataError, ModelLoadError) as err:
        print(f"openpack train_dpo: {err}", file=sys.stderr)
        return 2

