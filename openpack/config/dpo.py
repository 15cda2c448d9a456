"""``openpack train_dpo``: preference training with chosen/rejected pairs bin-packed under a token cap.

With no ``--pretrain`` and no ``--dataset`` it runs the built-in demo: the
SFT demo model (trained first and cached if absent) learns from preference
pairs of the addition task, and held-out preference accuracy and exact match
are reported before and after.

This module holds the command's own section (the losses and the reference model), its run config, its alias
and its checks; the first paragraph above is its ``--help`` description.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openpack.config.preference import PairTrainConfig, PreferenceDataConfig, check_pair_layout
from openpack.config.schema import ConfigError, RunConfig, arg
from openpack.config.sections import (FUSED_LOSS_HELP, LaunchConfig, ModelConfig, OutputConfig,
                                      check_consistency, check_inputs)
from openpack.core.losses import LOSS_SUMMARIES, PAIR_LOSSES, needs_reference
from openpack.orchestration.launch import launched_by_environment

DESCRIPTION = __doc__.split("\n\n")[0]
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "dpo.yaml"


@dataclass
class DPOConfig:
    ref_pretrain: str | None = arg(None, "reference model; default: --pretrain")
    beta: float = arg(0.1, "strength of the KL penalty towards the reference", above=0)
    loss_type: list[str] = arg(["sigmoid"], "preference losses (listed below); several are summed with --loss_weights",
                               choices=sorted(PAIR_LOSSES))
    loss_weights: list[float] | None = arg(None, "weight of each --loss_type", at_least=0,
                                           special={None: "1 for each --loss_type"})
    label_smoothing: float = arg(0.0, "cDPO / robust DPO / EXO: assumed share of flipped preference labels",
                                 at_least=0, below=1)
    nll_loss_coef: float = arg(0.0, "adds this weight of the chosen responses' NLL (the sft loss)", at_least=0)
    simpo_gamma: float = arg(0.5, "SimPO target reward margin", at_least=0)
    fused_loss: bool = arg(False, FUSED_LOSS_HELP + "; a chunk holds whole pairs")
    ref_offload: bool = arg(False, "keep the reference model's parameters on the CPU (ZeRO-3)")
    ref_logps_cache: str | None = arg(None, "file of precomputed reference log-probs: computed once, reused, reference freed")
    ref_num_nodes: int = arg(0, "nodes of the reference's own Ray actor group", at_least=0,
                             special={0: "the reference lives in the policy ranks"})
    ref_num_gpus_per_node: int = arg(1, "reference ranks per node with --ref_num_nodes (they must divide the policy ranks)",
                                     at_least=1)

    def losses(self) -> tuple[list[str], list[float]]:
        """The weighted loss terms: each --loss_type with its weight, and the sft term if --nll_loss_coef."""
        types, weights = list(self.loss_type), list(self.loss_weights or [1.0] * len(self.loss_type))
        if self.nll_loss_coef:
            types, weights = types + ["sft"], weights + [self.nll_loss_coef]
        return types, weights

    def validate(self):
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ConfigError(f"--loss_weights has {len(self.loss_weights)} values for {len(self.loss_type)} --loss_type")
        if self.label_smoothing >= 0.5 and set(self.loss_type) & {"sigmoid", "robust", "simpo"}:
            raise ConfigError(f"--label_smoothing must be < 0.5 for sigmoid, robust and simpo (a share of flipped "
                              f"labels of 0.5 or more inverts the preference), got {self.label_smoothing}")
        if self.label_smoothing == 0 and "exo_pair" in self.loss_type:
            raise ConfigError("--loss_type exo_pair needs --label_smoothing in (0, 1), e.g. 1e-3: EXO's target "
                              "distribution takes the log of it")
        if self.ref_num_nodes and self.ref_logps_cache:
            raise ConfigError("--ref_logps_cache computes the reference log-probs once and frees the reference; "
                              "a separate reference group (--ref_num_nodes) would sit idle: drop one of them")


@dataclass
class DPOTrainConfig(PairTrainConfig):
    learning_rate: float = arg(1e-5, "peak learning rate (AdamW; OpenRLHF's train_dpo default)", above=0)


LOSS_HELP = "loss types (--loss_type; details and formulas in docs/dpo.md):\n" + "\n".join(
    f"  {name:<13} {LOSS_SUMMARIES[name]}" for name in sorted(PAIR_LOSSES))


@dataclass
class DPORunConfig(RunConfig):
    """Everything one ``openpack train_dpo`` run is told, by section; what ``run_dpo`` receives."""

    model: ModelConfig
    data: PreferenceDataConfig
    train: DPOTrainConfig
    output: OutputConfig
    dpo: DPOConfig
    launch: LaunchConfig


CONFIGS = DPORunConfig.section_classes()  # the flag groups, in the order config.yaml lists them
ALIASES = {"--ipo": ("loss_type", ["ipo"])}


def check_reference_group(dpo_cfg: DPOConfig, launch_cfg: LaunchConfig) -> None:
    """--ref_num_nodes: a Ray actor group of its own, whose ranks divide the policy's, for losses with a reference."""
    if not dpo_cfg.ref_num_nodes:
        return
    if launch_cfg.launcher != "ray" or launched_by_environment():
        raise ConfigError("--ref_num_nodes places the reference in its own Ray actor group: it needs --launcher ray "
                          "(not --launcher local, torchrun or the deepspeed launcher)")
    ranks = launch_cfg.num_nodes * launch_cfg.num_gpus_per_node
    ref_ranks = dpo_cfg.ref_num_nodes * dpo_cfg.ref_num_gpus_per_node
    if ref_ranks > ranks or ranks % ref_ranks:
        raise ConfigError(f"{ref_ranks} reference ranks (--ref_num_nodes x --ref_num_gpus_per_node) must divide the "
                          f"{ranks} policy ranks (--num_nodes x --num_gpus_per_node), so each serves the same number")
    if not needs_reference(dpo_cfg.losses()[0]):
        raise ConfigError(f"--loss_type {' '.join(dpo_cfg.loss_type)} uses no reference model: drop --ref_num_nodes")


def check_dpo_context_parallel(dpo_cfg: DPOConfig, train_cfg: PairTrainConfig) -> None:
    """What train_dpo does not split over a context group (--ring_attn_size) yet, refused by name."""
    ring = train_cfg.ring_attn_size or 1
    if ring > 1 and dpo_cfg.fused_loss:
        raise ConfigError(f"--fused_loss with --ring_attn_size {ring}: a pair's gradient needs its log-prob sums over "
                          "every rank before any rank's logits are freed, which the one-pass loss cannot wait for; "
                          "drop --fused_loss")
    if ring > 1 and dpo_cfg.ref_num_nodes:
        raise ConfigError(f"--ref_num_nodes with --ring_attn_size {ring}: a separate reference group does not split "
                          "rows over ranks; drop --ref_num_nodes (the reference then runs in the policy's ranks, "
                          "split like the policy) or --ring_attn_size")


def check_dpo(cfg: DPORunConfig) -> DPORunConfig:
    """The checks across sections, then the model and data files, before Ray, DeepSpeed or a model load."""
    model_cfg, data_cfg, train_cfg, dpo_cfg = cfg.model, cfg.data, cfg.train, cfg.dpo
    check_pair_layout(data_cfg, train_cfg, cfg.launch)
    check_consistency(model_cfg, data_cfg.dataset, train_cfg, cfg.launch)
    if dpo_cfg.ref_offload and model_cfg.zero_stage != 3:
        raise ConfigError("--ref_offload needs --zero_stage 3 (the reference's parameters are offloaded by ZeRO-3)")
    check_reference_group(dpo_cfg, cfg.launch)
    check_dpo_context_parallel(dpo_cfg, train_cfg)
    check_inputs(data_cfg.dataset, {"--pretrain": model_cfg.pretrain, "--ref_pretrain": dpo_cfg.ref_pretrain},
                 prefix_sharing=data_cfg.prefix_sharing)
    return cfg
