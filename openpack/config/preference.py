"""The data section of the pair commands (``train_dpo``, ``train_rm``) and the checks they share: which keys hold
a pair, context parallelism, and whether a pair fits a packed row."""

from __future__ import annotations

from dataclasses import dataclass

from openpack.config.schema import ConfigError, arg
from openpack.config.sections import (DatasetConfig, LaunchConfig, TrainConfig, check_context_parallel,
                                      check_template_flags, packed_row_tokens, ring_attn_size_arg)


@dataclass
class PreferenceDataConfig(DatasetConfig):
    prompt_key: str = arg("prompt", "key of the prompt in each row; a row without it holds two whole conversations "
                          "whose shared start is the prompt (TRL's implicit prompt)")
    chosen_key: str = arg("chosen", "key of the preferred response")
    rejected_key: str = arg("rejected", "key of the dispreferred response")
    apply_chat_template: bool = arg(False, "text prompts become a user turn and text responses assistant turns of the "
                                    "tokenizer's chat template (lists of messages always do)")
    input_template: str | None = arg(None, "text prompts become this with {} replaced by the prompt, e.g. "
                                     "$'User: {}\\nAssistant: ' (OpenRLHF's flag)")
    prefix_sharing: bool = arg(False, "pack each pair as one group prompt | chosen | rejected, the prompt computed "
                               "once, with the same results (needs --packing_samples; docs/dpo.md)")
    max_len: int = arg(512, "max tokens per sequence (prompt + response; OpenRLHF's default for pairs)", at_least=2)

    def validate(self):
        check_template_flags(self.input_template, self.apply_chat_template)


@dataclass
class PairTrainConfig(TrainConfig):
    """The train section of the pair commands: the shared one, and context parallelism (docs/dpo.md)."""

    ring_attn_size: int | None = ring_attn_size_arg()


def check_pair_layout(data_cfg: PreferenceDataConfig, train_cfg: PairTrainConfig, launch_cfg: LaunchConfig) -> None:
    """A pair lands in one packed row whole; --prefix_sharing needs packing and no context parallelism."""
    check_context_parallel(train_cfg, launch_cfg)
    cap, flags = packed_row_tokens(train_cfg)
    if train_cfg.use_dynamic_batch and 2 * data_cfg.max_len > cap:
        raise ConfigError(
            f"a pair is up to 2 x --max_len = {2 * data_cfg.max_len} tokens, more than {flags}; "
            "lower --max_len or raise --max_tokens_per_gpu"
        )
    if data_cfg.prefix_sharing and not train_cfg.packing_samples:
        raise ConfigError("--prefix_sharing lays each pair out as one packed group prompt | chosen | rejected: add "
                          "--packing_samples (padded rows cannot share a prompt), or drop --prefix_sharing")
    if data_cfg.prefix_sharing and (train_cfg.ring_attn_size or 1) > 1:
        raise ConfigError(f"--prefix_sharing is not split over ranks: --ring_attn_size {train_cfg.ring_attn_size} "
                          "would need each response's keys to include its prompt's on other ranks; drop one of them")
