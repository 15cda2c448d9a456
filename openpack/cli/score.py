"""``openpack score``: parse and check the flags, tokenize the rows, score them here or on a Ray group of reward
actors, and write them out with their rewards. Its flags and what they mean are in ``config/score.py``."""

from __future__ import annotations

import sys

from openpack.config.runner import refused
from openpack.config.schema import ConfigError, parse_config
from openpack.config.score import (CONFIGS, DESCRIPTION, chat_template_choice, check_score, output_path,
                                   warn_if_raw_text)
from openpack.orchestration.actor_groups import score_sequences
from openpack.orchestration.launch import launch_command


def main(argv: list[str] | None = None) -> int:
    from openpack.data.demo_task import write_jsonl
    from openpack.data.loading import DataError, load_rows
    from openpack.data.scoring import tokenize_for_scoring
    from openpack.models.loading import ModelLoadError, load_tokenizer

    try:
        cfg, launch_cfg = parse_config(sys.argv[1:] if argv is None else argv, "openpack score", DESCRIPTION, *CONFIGS)
        check_score(cfg)
        rows, tokenizer = load_rows(cfg.dataset), load_tokenizer(cfg.reward_pretrain)
        sequences, raw_text = tokenize_for_scoring(rows, tokenizer, cfg.prompt_key, cfg.response_key, cfg.messages_key,
                                                   chat_template_choice(cfg))
    except (ConfigError, DataError, ModelLoadError) as err:
        return refused("score", err, 2)
    warn_if_raw_text(cfg, raw_text, tokenizer)
    scorer = (cfg.reward_pretrain, cfg.max_tokens_per_gpu, cfg.bf16, cfg.value_head_prefix)
    code, rewards = launch_command(lambda: score_sequences(scorer, sequences, launch_cfg), launch_cfg.launcher)
    if code:
        return code
    output = output_path(cfg)
    write_jsonl([{**row, "reward": reward} for row, reward in zip(rows.rows, rewards.tolist())], output)
    print(f"openpack score: {len(rows)} rewards written to {output} (mean {rewards.mean().item():.4f})")
    return 0
