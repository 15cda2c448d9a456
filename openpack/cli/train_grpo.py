"""``openpack train_grpo``: ``openpack train_ppo`` with GRPO's defaults (``--advantage_estimator group_norm``,
``--n_samples_per_prompt 8``); a --config file and flags override them as usual."""

from __future__ import annotations

import sys

from openpack.cli import train_ppo


def main(argv: list[str] | None = None) -> int:
    return train_ppo.main(sys.argv[1:] if argv is None else argv, "train_grpo", train_ppo.GRPORunConfig)
