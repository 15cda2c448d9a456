"""``openpack train_sft``: parse and check the flags, claim ``--save_path``, train (``config.runner.run_training``).

The command itself, its sections, demo, checks and launch, is ``config.commands.SFT``; its flags and what they
mean are in ``config/sft.py``.
"""

from __future__ import annotations

from openpack.config.commands import SFT
from openpack.config.runner import run_training


def main(argv: list[str] | None = None) -> int:
    return run_training(SFT, argv)
