"""``openpack train_sft``: supervised fine-tuning with packed, dynamically batched micro-batches.

With no ``--pretrain`` and no ``--dataset`` it runs the built-in demo: a
tiny model learns 2-digit addition from scratch on CPU in a few minutes and
reports held-out exact-match accuracy before and after training.

This module holds the command's own sections (its data keys, ``--fused_loss``), its run config and its checks;
the first paragraph above is its ``--help`` description.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openpack.config.schema import ConfigError, RunConfig, arg
from openpack.config.sections import (FUSED_LOSS_HELP, DatasetConfig, LaunchConfig, ModelConfig, OutputConfig,
                                      TrainConfig, check_consistency, check_context_parallel, check_inputs,
                                      check_template_flags, packed_row_tokens, ring_attn_size_arg)

DESCRIPTION = __doc__.split("\n\n")[0]
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "sft.yaml"
INPUT_TEMPLATE = "User: {}\nAssistant: "  # OpenRLHF 0.11's train_sft default


@dataclass
class DataConfig(DatasetConfig):
    input_key: str = arg("prompt", "key of the prompt in each row (else TRL's prompt/completion keys are read)")
    output_key: str = arg("response", "key of the response in each row, the only part trained on")
    apply_chat_template: bool = arg(False, "text prompt/response become a user and an assistant turn of the tokenizer's "
                                    "chat template (lists of messages always do)")
    messages_key: str = arg("messages", "key of a whole conversation (a list of {role, content} messages); a row "
                            "with it is a conversation, whatever else it holds")
    conversation_loss: str = arg("assistant", "tokens of a conversation (--messages_key) trained on: the assistant "
                                 "turns (TRL's assistant_only_loss), or all of them", choices=["assistant", "all"])
    input_template: str | None = arg(INPUT_TEMPLATE, "text prompts read by --input_key become this with {} "
                                     "replaced by the prompt (OpenRLHF's flag and default); not used with "
                                     "--apply_chat_template, in conversations or in TRL's prompt/completion rows",
                                     special={None: "prompts as they are"})

    def prompt_template(self) -> str | None:
        """The template text prompts get. Under --apply_chat_template, none when it is OpenRLHF's default, which
        OpenRLHF leaves unused with the chat template (another template with it is refused, as in every command)."""
        if self.apply_chat_template and self.input_template == INPUT_TEMPLATE:
            return None
        return self.input_template

    def validate(self):
        check_template_flags(self.prompt_template(), self.apply_chat_template)


@dataclass
class SFTTrainConfig(TrainConfig):
    max_epochs: int = arg(2, "passes over the data (OpenRLHF's train_sft default)", at_least=1)
    fused_loss: bool = arg(False, FUSED_LOSS_HELP)
    ring_attn_size: int | None = ring_attn_size_arg()


@dataclass
class SFTRunConfig(RunConfig):
    """Everything one ``openpack train_sft`` run is told, by section; what ``run_sft`` receives."""

    model: ModelConfig
    data: DataConfig
    train: SFTTrainConfig
    output: OutputConfig
    launch: LaunchConfig


CONFIGS = SFTRunConfig.section_classes()  # the flag groups, in the order config.yaml lists them


def check_sft(cfg: SFTRunConfig) -> SFTRunConfig:
    """The checks across sections, then the model and data files, before Ray, DeepSpeed or a model load."""
    check_context_parallel(cfg.train, cfg.launch)
    check_consistency(cfg.model, cfg.data.dataset, cfg.train, cfg.launch)
    cap, flags = packed_row_tokens(cfg.train)
    if cfg.train.use_dynamic_batch and cfg.data.max_len > cap:
        raise ConfigError(
            f"--max_len {cfg.data.max_len} exceeds {flags}: "
            "a sample could not fit a row; lower --max_len or raise --max_tokens_per_gpu"
        )
    check_inputs(cfg.data.dataset, {"--pretrain": cfg.model.pretrain})
    return cfg
