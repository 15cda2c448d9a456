"""``openpack score``: a reward for every row of a dataset, from a reward model ``openpack train_rm`` saved.

Each row (a conversation, or a prompt and a response) is tokenized as ``train_rm`` tokenized its pairs
(text rows through the chat template with ``--apply_chat_template``, as ``train_rm`` with that flag),
sequences are packed into rows of at most ``--max_tokens_per_gpu`` tokens, and each gets the reward at its
last token, normalised if the model was trained with ``--normalize_reward``. The output is the input rows,
each with a ``reward`` key added, in the same order. ``--launcher ray`` scores on a group of
``--reward_num_nodes`` x ``--reward_num_gpus_per_node`` actors, as an RLHF trainer's reward group does.

This module holds the command's sections and the choices made from them (the chat template, the output file); the
first paragraph above is its ``--help`` description.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from openpack.config.schema import ConfigError, arg
from openpack.config.sections import check_inputs

DESCRIPTION = __doc__.split("\n\n")[0]


@dataclass
class ScoreConfig:
    reward_pretrain: str | None = arg(None, "the reward model: a folder openpack train_rm saved (or any one-label "
                                      "*ForSequenceClassification)")
    dataset: list[str] | None = arg(None, "rows to score: local .json/.jsonl/.parquet files or folders, or hub names")
    output: str | None = arg(None, "JSONL file of the rows with their reward", special={None: "<dataset>.rewards.jsonl"})
    prompt_key: str = arg("prompt", "key of a row's prompt text")
    response_key: str = arg("response", "key of a row's response text (scored as prompt + response + eos)")
    messages_key: str = arg("messages", "key of a row's conversation (a list of {role, content} messages)")
    apply_chat_template: bool | None = arg(
        None, "text prompt/response rows become a user and an assistant turn of the tokenizer's chat template, as "
        "train_rm --apply_chat_template tokenized them (conversations always do)",
        special={None: "what the model's train_rm run recorded in its config.yaml, else raw text (with a warning "
                       "when the tokenizer has a chat template)"})
    value_head_prefix: str = arg("score", "name of the value head's weights in --reward_pretrain (OpenRLHF: "
                                 "value_head)")
    max_tokens_per_gpu: int = arg(16384, "token cap of a packed row", at_least=2)
    bf16: bool = arg(False, "score in bfloat16")

    def validate(self):
        if self.reward_pretrain is None or not self.dataset:
            raise ConfigError("give --reward_pretrain (a reward model folder) and --dataset (the rows to score)")
        if self.output is None and len(self.dataset) > 1:
            raise ConfigError("with several --dataset, name the file to write with --output")


@dataclass
class ScoreLaunchConfig:
    launcher: str = arg("local", "local: score in this process; ray: on a group of reward actors",
                        choices=["local", "ray"])
    ray_address: str | None = arg(None, "Ray cluster to attach to ('auto': the running one)",
                                  special={None: "$RAY_ADDRESS, else start a local one"})
    reward_num_nodes: int = arg(1, "nodes of the reward actor group (--launcher ray)", at_least=1)
    reward_num_gpus_per_node: int = arg(1, "reward actors per node; on a CPU-only cluster, CPU workers per node",
                                        at_least=1)
    num_cpus_per_worker: int | None = arg(None, "CPUs reserved for each actor (--launcher ray)", at_least=1,
                                          special={None: "the node's CPUs / --reward_num_gpus_per_node"})


CONFIGS = (ScoreConfig, ScoreLaunchConfig)


def check_score(cfg: ScoreConfig) -> None:
    """The rows' files and the reward model, before any model loads: a causal LM is refused here, by name."""
    from openpack.models.reward import check_reward_model

    check_inputs(cfg.dataset, {})
    check_reward_model(cfg.reward_pretrain, "--reward_pretrain")


def chat_template_choice(cfg: ScoreConfig) -> bool:
    """--apply_chat_template as given; unset, what the reward model's train_rm run recorded, said in one line.

    train_rm writes its flags to ``<save_path>/config.yaml`` and the model to ``<save_path>/model``, and that
    record says how its text rows were tokenized, so a model scored where train_rm left it is scored the same
    way by default. The choice is printed (an automatic choice is logged); a flag the user gave always wins.
    A model copied elsewhere has no record: it is scored as raw text, with the warning of ``warn_if_raw_text``.
    """
    if cfg.apply_chat_template is not None:
        return cfg.apply_chat_template
    saved = Path(cfg.reward_pretrain).parent / "config.yaml"
    try:
        recorded = (yaml.safe_load(saved.read_text()) or {}).get("apply_chat_template")
    except (OSError, yaml.YAMLError, AttributeError):  # no record, or not train_rm's flat mapping
        return False
    if recorded is not True:
        return False
    print(f"openpack score: --apply_chat_template, as {saved} records for the run that trained this model "
          "(--no_apply_chat_template scores text rows as raw text)")
    return True


def warn_if_raw_text(cfg: ScoreConfig, raw_text: int, tokenizer) -> None:
    """``raw_text`` text rows scored without a template although the model's tokenizer has one, and the user did
    not say: a chat-trained reward model scores such rows far off (issue 23: a mean of 9.84, against -0.15 as
    conversations)."""
    if raw_text and cfg.apply_chat_template is None and getattr(tokenizer, "chat_template", None):
        print(f"openpack score: warning: {raw_text} text rows scored as raw text, but the reward model's tokenizer "
              "has a chat template; if the model was trained on chat turns (conversations, or train_rm "
              "--apply_chat_template), pass --apply_chat_template to score each as a user and an assistant turn, "
              "or --no_apply_chat_template if it was trained on raw text", file=sys.stderr)


def output_path(cfg: ScoreConfig) -> Path:
    """--output, else ``<dataset>.rewards.jsonl`` beside the (one) dataset: its name up to the first dot."""
    if cfg.output:
        return Path(cfg.output)
    dataset = cfg.dataset[0]
    path = Path(dataset)
    if path.suffix:
        return path.with_name(path.name.split(".")[0] + ".rewards.jsonl")
    return Path(f"{dataset}.rewards.jsonl")
