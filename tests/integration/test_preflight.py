"""Every configuration error is found in the driver before Ray, DeepSpeed or a model load, as one line.

Each case exits 2 with a single line on stderr that names the flag and the fix. ``launch`` (which starts
Ray or the local worker) and the DPO demo's SFT stage are replaced by tripwires, so a check that only
happened later, inside a worker, fails the test.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from openpack.cli import train_dpo, train_sft
from openpack.config import commands


class Started(AssertionError):
    pass


@pytest.fixture(autouse=True)
def tripwires(monkeypatch):
    def started(*args, **kwargs):
        raise Started("the run started before the configuration was checked")

    monkeypatch.setattr(commands, "launch", started)
    monkeypatch.setattr(commands, "demo_sft_model", started)


def run(main, argv) -> int:
    """The exit code, whether ``main`` returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("flags,expected", [
    (["--loss_type", "dpo"], "argument --loss_type: invalid choice: 'dpo'"),
    (["--beta", "0"], "--beta must be > 0, got 0.0"),
    (["--learning_rate", "-0.001"], "--learning_rate must be > 0, got -0.001"),
    (["--logging_steps", "0"], "--logging_steps must be >= 1, got 0"),
    (["--max_steps", "0"], "--max_steps must be >= 1, got 0 (stop after this many optimizer steps; none means train"),
    (["--no_use_dynamic_batch", "--train_batch_size", "6", "--micro_train_batch_size", "4"],
     "--train_batch_size 6 does not split into micro-batches of --micro_train_batch_size 4 on 1 data-parallel rank(s)"),
    (["--input_template", "User: {}\\nAssistant: "], "holds the two characters \\n, not a newline"),
    (["--input_template", "{}", "--apply_chat_template"], "drop one of the two"),
    (["--launcher", "ray", "--num_gpus_per_node", "4", "--no_use_dynamic_batch", "--train_batch_size", "6"],
     "--train_batch_size 6 does not split into micro-batches of --micro_train_batch_size 1 on 4 data-parallel rank(s)"),
])
def test_bad_flags_of_the_demo_fail_before_it_starts(capsys, flags, expected):
    assert run(train_dpo.main, [*flags, "--launcher", "local"] if "--launcher" not in flags else flags) == 2
    assert expected in one_line(capsys)


def test_an_unknown_loss_in_a_config_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("loss_type: [sigmoid, dpo]\n")
    assert train_dpo.main(["--config", str(config)]) == 2
    assert "key 'loss_type': 'dpo' is not one of apo_down" in one_line(capsys)


def test_help_lists_every_loss_with_a_line(capsys):
    from openpack.core.losses import PAIR_LOSSES

    with pytest.raises(SystemExit):
        train_dpo.main(["--help"])
    out = capsys.readouterr().out
    listing = out[out.index("loss types (--loss_type"):].splitlines()[1:]
    assert [line.split()[0] for line in listing] == sorted(PAIR_LOSSES)


def test_a_bad_ref_pretrain_is_named_as_such(tmp_path, tiny_pretrain, dpo_jsonl, capsys):
    argv = ["--pretrain", tiny_pretrain, "--dataset", dpo_jsonl, "--save_path", str(tmp_path)]
    assert train_dpo.main([*argv, "--ref_pretrain", str(tmp_path / "no_such_model")]) == 2
    err = one_line(capsys)
    assert err.startswith("openpack train_dpo: --ref_pretrain ") and "no such folder" in err
    assert train_dpo.main([*argv, "--ref_pretrain", str(tmp_path)]) == 2  # a folder, but no model in it
    assert "--ref_pretrain" in one_line(capsys)


def test_a_missing_dataset_is_found_before_the_run(tmp_path, tiny_pretrain, capsys):
    assert train_sft.main(["--pretrain", tiny_pretrain, "--dataset", str(tmp_path / "nope.jsonl")]) == 2
    err = one_line(capsys)
    assert "--dataset" in err and "nope.jsonl: file not found" in err


def test_an_unreadable_dataset_is_found_before_the_run():
    """Root reads any file whatever its mode, so under root the check runs as user nobody in a forked child."""
    from openpack.data.loading import DataError, check_dataset_files

    folder = Path(tempfile.mkdtemp(prefix="openpack-unreadable-"))  # not under pytest's 0700 tmp root
    try:
        folder.chmod(0o755)
        data = folder / "secret.jsonl"
        data.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
        data.chmod(0o000)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop root if we are root, check, report the message, exit
            try:
                if os.geteuid() == 0:
                    os.setuid(65534)
                check_dataset_files([str(data)])
                message = "no error"
            except DataError as err:
                message = str(err)
            os.write(write_end, message.encode())
            os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        with os.fdopen(read_end) as pipe:
            message = pipe.read()
        assert f"--dataset {data}: cannot read {data} (Permission denied)" in message
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("flags,expected", [
    (["--policy_loss_type", "cispo", "--dual_clip", "3"], "--dual_clip bounds a clipped ratio's loss"),
    (["--dual_clip", "1"], "--dual_clip must be > 1, got 1.0"),
    (["--policy_loss_type", "grpo"], "argument --policy_loss_type: invalid choice: 'grpo'"),
    (["--entropy_coef", "-0.1"], "--entropy_coef must be >= 0, got -0.1"),
    (["--is_correction_type", "tis", "--vllm_is_correction_cap", "2"], "give one of the two"),
    (["--is_correction_threshold", "0.5", "2"], "--is_correction_threshold is the band of --is_correction_type"),
    (["--is_correction_type", "icepop", "--is_correction_threshold", "2", "0.5"], "low <= high"),
    (["--is_correction_type", "icepop", "--rollout_backend", "hf"], "--is_correction_type corrects vLLM's sampling"),
])
def test_bad_policy_loss_and_correction_flags_fail_before_the_run(capsys, flags, expected):
    from openpack.cli import train_grpo

    assert run(train_grpo.main, [*flags, "--launcher", "local"]) == 2
    assert expected in one_line(capsys)


@pytest.mark.parametrize("flags,expected", [
    (["--eval_steps", "2"], "--eval_steps shape the held-out evaluation, and there is none: add --eval_prompt_data"),
    (["--best_metric_key", "eval/reward/pass@1", "--eval_temperature", "1"],
     "--eval_temperature, --best_metric_key shape the held-out evaluation, and there is none"),
    (["--eval_steps", "0"], "--eval_steps must be >= 1, got 0"),
    (["--eval_prompt_data", "{held_out}", "--eval_n_samples_per_prompt", "4", "--eval_temperature", "0"],
     "--eval_temperature 0 is greedy: --eval_n_samples_per_prompt 4 would repeat one completion"),
    (["--eval_prompt_data", "{held_out}", "--eval_n_samples_per_prompt", "4", "--best_metric_key", "eval/reward/pass@8"],
     "--best_metric_key eval/reward/pass@8 is not a metric this run's evaluation logs; choose one of: "
     "eval/reward/pass@1, eval/reward/pass@2, eval/reward/pass@4, eval/reward/mean_reward"),
    (["--eval_prompt_data", "{held_out}.missing"], "--eval_prompt_data {held_out}.missing"),
])
def test_bad_evaluation_flags_fail_before_the_run(capsys, tmp_path, flags, expected):
    from openpack.cli import train_grpo

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    flags = [f.format(held_out=held_out) for f in flags]
    assert run(train_grpo.main, [*flags, "--rollout_backend", "hf", "--launcher", "local"]) == 2
    assert expected.format(held_out=held_out) in one_line(capsys)


@pytest.mark.parametrize("command,flags", [
    ("train_sft", ["--attn_backend", "flash_attn"]),
    ("train_dpo", ["--attn_backend", "flash_attn", "--launcher", "ray"]),
    ("train_grpo", ["--ds.attn_implementation", "flash_attention_2", "--launcher", "ray"]),
])
def test_a_missing_attention_backend_is_refused_before_any_worker(command, flags, capsys, monkeypatch):
    """Issue 41: on a machine without flash-attn, --attn_backend flash_attn (or OpenRLHF's flash_attention_2)
    ended in an ImportError traceback relayed by Ray from the workers. Now the driver says so in one line."""
    import importlib

    from openpack.models import attention

    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)  # also where flash-attn is installed
    main = importlib.import_module(f"openpack.cli.{command}").main
    assert run(main, flags) == 2
    line = one_line(capsys)
    assert "--attn_backend flash_attn: flash-attn is not installed here" in line and "Traceback" not in line


def test_a_cluster_s_workers_are_not_judged_by_the_driver_s_kernels(monkeypatch):
    """With --ray_address the ranks run elsewhere (a CPU head node drives GPU workers): the driver's missing
    flash-attn is no reason to refuse."""
    from types import SimpleNamespace

    from openpack.config.sections import ConfigError, check_attention_backend
    from openpack.models import attention

    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)
    model = SimpleNamespace(attn_backend="flash_attn")
    check_attention_backend(model, SimpleNamespace(launcher="ray", ray_address="10.0.0.1:6379"))
    with pytest.raises(ConfigError):
        check_attention_backend(model, SimpleNamespace(launcher="ray", ray_address=None))
