"""The console entry point: command listing, dispatch, errors, and check_packing end to end."""

import subprocess
import sys

from openpack.cli import check_packing
from openpack.cli.main import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_exits_2(capsys):
    assert main(["train_everything"]) == 2
    assert "unknown command 'train_everything'" in capsys.readouterr().err


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "check_packing" in result.stdout


def test_check_packing_passes_on_cpu(capsys):
    assert check_packing.main(["--archs", "llama", "mistral", "--lengths", "3", "17", "1", "9"]) == 0
    assert "exact across 2 architectures" in capsys.readouterr().out


def test_check_packing_fails_when_the_tolerance_is_impossible(capsys):
    """The verdict can fail: a negative tolerance is below any measured error."""
    assert check_packing.main(["--archs", "qwen2", "--tolerance", "-1"]) == 1
    assert "NOT exact for qwen2 (packed), qwen2 (prefix_shared)" in capsys.readouterr().out


def test_check_packing_rejects_an_unknown_arch(capsys):
    assert check_packing.main(["--archs", "gpt9"]) == 2
    assert "--archs: unknown ['gpt9']" in capsys.readouterr().err


def example_commands():
    """Every `openpack <command> ...` line in examples/ (shell scripts), as argv lists."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    for script in sorted(root.glob("*.sh")):
        text = script.read_text().replace("\\\n", " ")  # join continued lines
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("openpack "):
                yield script.name, shlex.split(line)[1:]


def test_example_scripts_use_real_flags():
    from openpack.config import dpo, rl, rm, score, sft
    from openpack.config import check_packing as check_packing_config
    from openpack.config.schema import parse_config

    sections = {"train_sft": sft.CONFIGS, "train_dpo": dpo.CONFIGS, "train_rm": rm.CONFIGS, "train_ppo": rl.CONFIGS,
                "train_grpo": rl.GRPO_CONFIGS, "score": score.CONFIGS, "check_packing": check_packing_config.CONFIGS}
    assert set(sections) == set(COMMANDS)
    commands = list(example_commands())
    assert {name for name, _ in commands} >= {"dpo_8b_2x8_zero3.sh", "sft_1node.sh", "check_packing_gpu.sh"}
    for script, (command, *flags) in commands:
        assert command in COMMANDS, f"{script}: unknown command {command}"
        parse_config(flags, f"openpack {command}", "", *sections[command])  # exits 2 on a bad flag
