"""The data section of the pair commands (``train_dpo``, ``train_rm``) and the checks they share: which keys hold
a pair, and whether a pair fits a packed row."""

from __future__ import annotations

from dataclasses import dataclass

from openpack.config.schema import ConfigError, arg
from openpack.config.sections import DatasetConfig, TrainConfig, check_template_flags


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

    def validate(self):
        check_template_flags(self.input_template, self.apply_chat_template)


def check_prefix_sharing(data_cfg: PreferenceDataConfig, train_cfg: TrainConfig) -> None:
    """--prefix_sharing lays a pair out in one packed row, so it needs --packing_samples."""
    if data_cfg.prefix_sharing and not train_cfg.packing_samples:
        raise ConfigError("--prefix_sharing lays each pair out as one packed group prompt | chosen | rejected: add "
                          "--packing_samples (padded rows cannot share a prompt), or drop --prefix_sharing")


def check_pair_fits(data_cfg: PreferenceDataConfig, train_cfg: TrainConfig) -> None:
    """Under --use_dynamic_batch a pair (chosen and rejected, each up to --max_len) lands in one row whole."""
    if train_cfg.use_dynamic_batch and 2 * data_cfg.max_len > train_cfg.max_tokens_per_gpu:
        raise ConfigError(
            f"a pair is up to 2 x --max_len = {2 * data_cfg.max_len} tokens, more than --max_tokens_per_gpu "
            f"{train_cfg.max_tokens_per_gpu}; lower --max_len or raise --max_tokens_per_gpu"
        )
