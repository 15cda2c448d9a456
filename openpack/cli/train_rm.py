"""``openpack train_rm``: parse and check the flags, claim ``--save_path``, train (``config.runner.run_training``).

The command itself, its sections, demo, checks and launch, is ``config.commands.RM``; its flags and what they
mean are in ``config/rm.py``.
"""

from __future__ import annotations

from openpack.config.commands import RM
from openpack.config.runner import run_training


def main(argv: list[str] | None = None) -> int:
    return run_training(RM, argv)
