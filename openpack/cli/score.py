"""``openpack score``: a reward for every row of a dataset, from a reward model ``openpack train_rm`` saved.

Each row (a conversation, or a prompt and a response) is tokenized as ``train_rm`` tokenized its pairs
(text rows through the chat template with ``--apply_chat_template``, as ``train_rm`` with that flag),
sequences are packed into rows of at most ``--max_tokens_per_gpu`` tokens, and each gets the reward at its
last token, normalised if the model was trained with ``--normalize_reward``. The output is the input rows,
each with a ``reward`` key added, in the same order. ``--launcher ray`` scores on a group of
``--reward_num_nodes`` x ``--reward_num_gpus_per_node`` actors, as an RLHF trainer's reward group does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from openpack.config.schema import ConfigError, arg, parse_config
from openpack.config.sections import check_inputs
from openpack.orchestration.launch import launch_command


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


def build_scorer(cfg: ScoreConfig):
    """What each process that scores builds: the reward model on this process's device (module level, for Ray)."""
    import torch

    from openpack.models.reward import RewardScorer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return RewardScorer(cfg.reward_pretrain, device, cfg.max_tokens_per_gpu, cfg.bf16, cfg.value_head_prefix)


def main(argv: list[str] | None = None) -> int:
    from openpack.data.loading import DataError, load_rows
    from openpack.models.loading import ModelLoadError

    try:
        cfg, launch_cfg = parse_config(sys.argv[1:] if argv is None else argv, "openpack score",
                                       __doc__.split("\n\n")[0], *CONFIGS)
        check_inputs(cfg.dataset, {})
        from openpack.models.reward import check_reward_model

        check_reward_model(cfg.reward_pretrain, "--reward_pretrain")
    except (ConfigError, DataError, ModelLoadError) as err:
        print(f"openpack score: {err}", file=sys.stderr)
        return 2
    from openpack.data.scoring import tokenize_for_scoring
    from openpack.models.loading import load_tokenizer

    try:
        rows, tokenizer = load_rows(cfg.dataset), load_tokenizer(cfg.reward_pretrain)
        sequences, raw_text = tokenize_for_scoring(rows, tokenizer, cfg.prompt_key, cfg.response_key, cfg.messages_key,
                                                   chat_template_choice(cfg))
    except (DataError, ModelLoadError) as err:
        print(f"openpack score: {err}", file=sys.stderr)
        return 2
    if raw_text and cfg.apply_chat_template is None and getattr(tokenizer, "chat_template", None):
        # Issue 23: a chat-trained reward model gave such rows a mean of 9.84, against -0.15 as conversations.
        print(f"openpack score: warning: {raw_text} text rows scored as raw text, but the reward model's tokenizer "
              "has a chat template; if the model was trained on chat turns (conversations, or train_rm "
              "--apply_chat_template), pass --apply_chat_template to score each as a user and an assistant turn, "
              "or --no_apply_chat_template if it was trained on raw text", file=sys.stderr)
    code, rewards = launch_command(lambda: _score(cfg, launch_cfg, sequences), launch_cfg.launcher)
    if code:
        return code
    output = Path(cfg.output or _default_output(cfg.dataset[0]))
    _write_rows([{**row, "reward": reward} for row, reward in zip(rows.rows, rewards.tolist())], output)
    print(f"openpack score: {len(rows)} rewards written to {output} (mean {rewards.mean().item():.4f})")
    return 0


def chat_template_choice(cfg: ScoreConfig) -> bool:
    """--apply_chat_template as given; unset, what the reward model's train_rm run recorded, said in one line.

    train_rm writes its flags to ``<save_path>/config.yaml`` and the model to ``<save_path>/model``, and that
    record says how its text rows were tokenized, so a model scored where train_rm left it is scored the same
    way by default. The choice is printed (an automatic choice is logged); a flag the user gave always wins.
    A model copied elsewhere has no record: it is scored as raw text, with the warning ``main`` prints.
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


def _score(cfg: ScoreConfig, launch_cfg: ScoreLaunchConfig, sequences: list[list[int]]):
    if launch_cfg.launcher == "local":
        return build_scorer(cfg).score(sequences)
    from openpack.orchestration.ray_launcher import cluster_address, score_on_ray

    return score_on_ray(build_scorer, (cfg,), sequences, num_nodes=launch_cfg.reward_num_nodes,
                        num_gpus_per_node=launch_cfg.reward_num_gpus_per_node,
                        num_cpus_per_worker=launch_cfg.num_cpus_per_worker,
                        ray_address=cluster_address(launch_cfg.ray_address))


def _default_output(dataset: str) -> str:
    path = Path(dataset)
    return str(path.with_name(path.name.split(".")[0] + ".rewards.jsonl")) if path.suffix else f"{dataset}.rewards.jsonl"


def _write_rows(rows: list[dict], path: Path) -> None:
    """One JSON object per line, written to a temporary file and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)
