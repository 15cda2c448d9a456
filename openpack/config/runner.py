"""What every ``openpack train_*`` command does around its training, written once: read the flags (the built-in
demo's when none name a model or data), check them, claim ``--save_path``, train, and turn the errors a user can act
on into one line on stderr and an exit code.

A command is a ``TrainingCommand``: its name, its run config, its demo, its checks and its training, all values,
so ``run_training`` serves the five commands and also runs one command as another's first stage (the demos chain
SFT -> RM -> PPO; ``commands.py``). The exit codes: 2 for input to fix (a flag, a file, a model, a taken save
path), 1 for a run that a reward, an environment or non-finite steps (``distributed/nonfinite.py``) stopped
midway; the launcher adds its own (``launch.py``: 1 for a dead rank, 130 and 143 for Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from openpack.config import openrlhf
from openpack.config.schema import ConfigError, RunConfig, special_values
from openpack.config.sections import check_attention_backend
from openpack.orchestration.launch import launched_by_environment


@dataclass(frozen=True)
class TrainingCommand:
    """One ``openpack train_*`` command, as ``run_training`` runs it."""

    name: str  # train_sft
    description: str  # the first line of --help
    run_config: type[RunConfig]
    demo_config: Path  # the built-in demo's flags, read when no --pretrain, data flag or --config is given
    prepare: Callable[[Any], Any]  # the checks across sections; returns the config to run (with choices made)
    train: Callable[[Any], int]  # run the ranks (inside --save_path's lock); their exit code
    data_flag: str = "--dataset"
    flag_demos: dict[str, Path] = field(default_factory=dict)  # another demo's flags, chosen by a flag given
    aliases: dict[str, tuple[str, Any]] | None = None
    epilog: str | None = None


def run_training(command: TrainingCommand, argv: list[str] | None) -> int:
    """Parse and check ``argv`` (``sys.argv[1:]`` when None), claim --save_path, train; the exit code."""
    from openpack.data.loading import DataError
    from openpack.distributed.save_path import CheckpointError, own_save_path
    from openpack.models.loading import ModelLoadError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # OpenRLHF 0.11's names become openpack's first: every step below sees one command line
        translated = openrlhf.translate(command.name, argv)
    except ConfigError as err:
        return refused(command.name, err, 2)
    argv, demo_notice = with_demo_defaults(translated.argv, command.name, demo_config(command, translated.argv),
                                           command.data_flag)
    epilog = "\n\n".join(text for text in (openrlhf.help_epilog(command.name), command.epilog) if text)
    try:
        cfg = command.run_config.parse(argv, f"openpack {command.name}", command.description,
                                       aliases=command.aliases, epilog=epilog or None,
                                       twins=openrlhf.help_names(command.name))
        check_attention_backend(cfg.model, getattr(cfg, "launch", None))  # first: the cheapest check, and every command has one
        cfg = command.prepare(cfg)
    except (ConfigError, DataError, ModelLoadError) as err:
        return refused(command.name, err, 2)
    announce(command.name, cfg, demo_notice, translated.notes)
    from openpack.distributed.nonfinite import NonFiniteStop
    from openpack.rl.agents.runner import EnvFailureError
    from openpack.rl.rewards import RewardError

    try:
        with own_save_path(cfg.output, launched_by_environment()):  # lock; refuse a taken --save_path
            return command.train(cfg)
    except (DataError, ModelLoadError, CheckpointError) as err:
        return refused(command.name, err, 2)
    except (RewardError, EnvFailureError, NonFiniteStop) as err:  # a reward or environment that failed mid-run,
        return refused(command.name, err, 1)  # or a diverged run: its message names the batch or the step


def refused(command: str, err: Exception, code: int) -> int:
    """``err``'s message, which names the flag, file or batch, as one line on stderr; ``code`` is the exit code."""
    print(f"openpack {command}: {err}", file=sys.stderr)
    return code


def demo_config(command: TrainingCommand, argv: list[str]) -> Path:
    """The command's demo, or the one a flag in ``argv`` asks for (``--demo agent``)."""
    given = {a.split("=")[0] for a in argv}
    return next((path for flag, path in command.flag_demos.items() if flag in given), command.demo_config)


def with_demo_defaults(argv: list[str], command: str, demo_config: Path,
                       data_flag: str = "--dataset") -> tuple[list[str], str | None]:
    """No --pretrain, ``data_flag`` or --config: the built-in demo, its defaults from a YAML shown to the user.

    Returns the argv to parse and the line announcing the demo (printed once the flags are known good).
    """
    if any(a.split("=")[0] in ("--pretrain", data_flag, "--config", "-h", "--help") for a in argv):
        return argv, None
    notice = (f"openpack {command}: no --pretrain/{data_flag}, running the built-in demo with defaults from "
              f"{demo_config}")
    return ["--config", str(demo_config), *argv], notice


def announce(command: str, cfg: RunConfig, demo_notice: str | None, accepted: list[str] | None = None) -> None:
    """What is about to run: the demo notice, the OpenRLHF flags accepted with nothing to set (one line each), and
    every flag whose value has a meaning of its own."""
    if demo_notice:
        print(demo_notice)
    for note in accepted or []:
        print(f"openpack {command}: {note}")
    special = special_values(*cfg.sections())
    if special:
        print(f"openpack {command}: " + "; ".join(special))
