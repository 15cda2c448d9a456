"""A demo's first stage (the SFT demo model, the reward-model demo) that fails or is stopped ends the command
with that stage's exit code, not a traceback: the stage has already said why (Ctrl-C during the DPO demo's SFT
stage printed "RuntimeError: the SFT demo run failed" with its traceback)."""

import pytest

from openpack.cli import train_rm, train_sft
from openpack.cli.train_sft import LaunchConfig


@pytest.mark.parametrize("module, stage", [(train_sft, train_sft.demo_sft_model), (train_rm, train_rm.demo_rm_model)])
@pytest.mark.parametrize("code", [130, 1])
def test_a_failed_or_stopped_stage_exits_with_its_code(module, stage, code, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENPACK_CACHE", str(tmp_path))
    monkeypatch.setattr(module, "main", lambda argv: code)
    with pytest.raises(SystemExit) as stopped:
        stage(LaunchConfig(), 42)
    assert stopped.value.code == code
    assert "Traceback" not in capsys.readouterr().err
