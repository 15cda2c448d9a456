"""Write ``flags.tsv``: every flag OpenRLHF 0.11.0's training commands define, read from its source.

Usage: ``python extract_flags.py GIT_DIR`` (a clone of github.com/OpenRLHF/OpenRLHF with the tag v0.11.0). For each
of ``openrlhf/cli/train_{sft,dpo,rm,ppo_ray}.py`` the statements of its ``__main__`` block up to ``parse_args`` are
run (they only build the ``argparse`` parser; nothing of openrlhf is imported), and every option string is written
as one line: the command, the flag, how many values it takes (0 for a switch, ``*`` for any number) and its default
as JSON. 77, 82, 79 and 164 flags.
"""

import argparse
import ast
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

COMMANDS = ("train_sft", "train_dpo", "train_rm", "train_ppo_ray")


def parser_of(source: str, name: str) -> argparse.ArgumentParser:
    tree = ast.parse(source)
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body = []
    for statement in main.body:
        if "parse_args" in ast.unparse(statement):
            break
        body.append(statement)
    scope = {"argparse": argparse, "datetime": datetime}
    exec(compile(ast.Module(body=body, type_ignores=[]), name, "exec"), scope)
    return scope["parser"]


def nargs(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "0"
    return "1" if action.nargs is None else str(action.nargs)


def default(action: argparse.Action):
    value = action.default
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    if action.dest.endswith("wandb.run_name"):  # the launch time: "sft_%m%dT%H:%M"
        return value.rsplit("_", 1)[0] + "_%m%dT%H:%M"
    return value


def main(git_dir: str) -> None:
    lines = ["# command\tflag\tnargs\tdefault (JSON): OpenRLHF v0.11.0, written by extract_flags.py"]
    for command in COMMANDS:
        path = f"openrlhf/cli/{command}.py"
        source = subprocess.run(["git", "--git-dir", git_dir, "show", f"v0.11.0:{path}"], check=True,
                                capture_output=True, text=True).stdout
        for action in parser_of(source, path)._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    lines.append(f"{command}\t{flag}\t{nargs(action)}\t{json.dumps(default(action))}")
    (Path(__file__).parent / "flags.tsv").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
