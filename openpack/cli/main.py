"""``openpack <command> [flags]``: dispatch to one module per command.

Commands are imported only when run, so ``openpack --help`` stays fast and a
command's heavy imports (DeepSpeed, Ray) never slow down another's.
"""

from __future__ import annotations

import importlib
import sys

from openpack import __version__

# name -> (module, one-line summary); every module has main(argv) -> int
COMMANDS = {
    "train_sft": ("openpack.cli.train_sft", "supervised fine-tuning with packed, dynamically batched micro-batches"),
    "train_dpo": ("openpack.cli.train_dpo", "DPO-family preference training with chosen/rejected pairs bin-packed"),
    "train_rm": ("openpack.cli.train_rm", "Bradley-Terry reward models on bin-packed pairs, exported as classifiers"),
    "train_ppo": ("openpack.cli.train_ppo", "online RL (REINFORCE++, RLOO, GRPO...) on packed experience, vLLM or HF"),
    "train_grpo": ("openpack.cli.train_grpo", "train_ppo with GRPO's defaults (group_norm, 8 completions per prompt)"),
    "score": ("openpack.cli.score", "a reward for every row of a dataset, from a reward model train_rm saved"),
    "check_packing": (
        "openpack.cli.check_packing",
        "check that packed forwards equal unpacked ones on this machine's attention backend",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: openpack <command> [flags]   (openpack <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"openpack {__version__}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        print(f"openpack: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
