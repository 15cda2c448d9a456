"""A demo's first stage (the SFT demo model, the reward-model demo) that fails or is stopped ends the command
with that stage's exit code, not a traceback: the stage has already said why (Ctrl-C during the DPO demo's SFT
stage printed "RuntimeError: the SFT demo run failed" with its traceback)."""

import pytest

from openpack.config import commands
from openpack.config.sections import LaunchConfig


@pytest.mark.parametrize("stage", [commands.demo_sft_model, commands.demo_rm_model])
@pytest.mark.parametrize("code", [130, 1])
def test_a_failed_or_stopped_stage_exits_with_its_code(stage, code, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENPACK_CACHE", str(tmp_path))
    monkeypatch.setattr(commands, "run_training", lambda command, argv: code)
    with pytest.raises(SystemExit) as stopped:
        stage(LaunchConfig(), 42)
    assert stopped.value.code == code
    assert "Traceback" not in capsys.readouterr().err
