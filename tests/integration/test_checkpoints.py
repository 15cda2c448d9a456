"""Checkpoints that cannot eat a run (issue 12): one run per save path, a lock, exact resume or none,
verified checkpoints, and a full disk that leaves the previous checkpoint intact.

Each test runs the real ``train_sft`` CLI in-process with ``--launcher local``
on the tiny model, 1 to 4 steps of 8 samples; the Ray and torchrun tests run
it in a subprocess.
"""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from openpack.cli import train_sft
from openpack.distributed.checkpoint import verify
from openpack.distributed.process import free_port

from hang_guard import HANG_S
from saved_runs import BARE_PROMPTS, read_metrics

FLAGS = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
         "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100",
         "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128", *BARE_PROMPTS]


@pytest.fixture
def sft(tiny_pretrain, sft_jsonl):
    def run(save_path, *flags, launcher=("--launcher", "local")) -> int:
        return train_sft.main(["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(save_path),
                               *FLAGS, *launcher, *flags])
    return run


def tags(save_path) -> list[str]:
    return sorted((p.name for p in (Path(save_path) / "checkpoints").glob("global_step*")), key=lambda t: int(t[11:]))


def latest(save_path) -> str:
    return (Path(save_path) / "checkpoints" / "latest").read_text().strip()


def test_a_new_run_into_another_runs_folder_is_refused_and_overwrite_starts_anew(tmp_path, sft, capsys):
    """Today the second run pruned its own checkpoint at once (the old ones had higher steps) and left
    `latest` naming a deleted folder."""
    assert sft(tmp_path, "--max_steps", "3", "--save_steps", "1") == 0
    capsys.readouterr()
    assert sft(tmp_path, "--save_steps", "1", "--max_ckpt_num", "1") == 2
    err = capsys.readouterr().err
    first_run = json.loads((tmp_path / "run.json").read_text())["run_id"]
    assert "global_step3" in err and f"run {first_run}" in err
    assert "--load_checkpoint" in err and "another --save_path" in err and "--overwrite" in err
    assert tags(tmp_path) == ["global_step1", "global_step2", "global_step3"] and latest(tmp_path) == "global_step3"

    assert sft(tmp_path, "--save_steps", "1", "--max_ckpt_num", "1", "--overwrite") == 0
    assert tags(tmp_path) == ["global_step2"] and latest(tmp_path) == "global_step2"
    assert verify(tmp_path / "checkpoints" / "global_step2") is None
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] != first_run
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]


def test_a_save_path_in_use_is_refused_naming_the_holder_and_a_stale_lock_taken_over(tmp_path, sft, capsys):
    holder = subprocess.Popen(["sleep", "120"])  # a live process on this host holds the lock
    lock = {"pid": holder.pid, "host": socket.gethostname(), "started": "2026-11-23T10:00:00+00:00"}
    (tmp_path / "run.lock").write_text(json.dumps(lock))
    try:
        assert sft(tmp_path) == 2
        err = capsys.readouterr().err
        assert f"in use by another openpack run: pid {holder.pid} on host {socket.gethostname()}" in err
        assert not (tmp_path / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    assert sft(tmp_path) == 0  # the holder is gone: its lock is stale
    assert f"took over the stale lock {tmp_path / 'run.lock'} of pid {holder.pid}" in capsys.readouterr().out
    assert not (tmp_path / "run.lock").exists()  # released at the end


def test_resume_is_exact_or_refused_listing_the_settings_that_differ(tmp_path, sft, capsys):
    """Today a changed --train_batch_size resumed silently and skipped 24 of the 48 samples."""
    assert sft(tmp_path) == 0
    capsys.readouterr()
    assert sft(tmp_path, "--load_checkpoint", "--train_batch_size", "16", "--max_steps", "3") == 2
    err = capsys.readouterr().err
    assert "train_batch_size 8 -> 16" in err and "max_steps 2 -> 3" in err and "global_step2" in err
    assert tags(tmp_path) == ["global_step2"] and [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert "train_batch_size: 8" in (tmp_path / "config.yaml").read_text()  # the refused run saved nothing

    # more steps over the same data order continue exactly where the checkpoint stopped
    assert sft(tmp_path, "--load_checkpoint", "--max_steps", "4", "--logging_steps", "2") == 0
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'checkpoints'} at step 2" in out and "max_steps 2 -> 4" in out
    uninterrupted = tmp_path.parent / "uninterrupted"
    assert sft(uninterrupted, "--max_steps", "4") == 0
    resumed, full = read_metrics(tmp_path), read_metrics(uninterrupted)
    assert [m["step"] for m in resumed] == [1, 2, 4]
    assert resumed[-1]["loss"] == pytest.approx(full[-1]["loss"], abs=1e-5)


def test_optimizer_state_in_another_zero_layout_is_refused_with_the_fix(tmp_path, sft, capsys):
    """One CPU rank runs --zero_stage 2 as DeepSpeed's stage 0, but with --adam_offload as ZeRO-2: the flags can
    agree while the optimizer files differ. Without the check, DeepSpeed's stage-0 loader fails inside torch."""
    assert sft(tmp_path, "--adam_offload") == 0
    assert list((tmp_path / "checkpoints" / "global_step2").glob("*optim_states.pt"))  # ZeRO's partitions
    out = capsys.readouterr().out
    assert "runs as DeepSpeed's stage 0" not in out
    assert sft(tmp_path, "--load_checkpoint", "--max_steps", "3") == 2
    err = capsys.readouterr().err
    assert "global_step2" in err and "ZeRO's partitions layout" in err and "(ZeRO stage 0)" in err
    assert f"--pretrain {tmp_path / 'checkpoints' / 'global_step2' / 'hf_model'}" in err and "Traceback" not in err
    assert sft(tmp_path, "--load_checkpoint", "--max_steps", "3", "--adam_offload") == 0
    assert f"resumed from {tmp_path / 'checkpoints'} at step 2" in capsys.readouterr().out


def test_one_cpu_rank_runs_zero_2_as_stage_0_and_says_so(tmp_path, sft, capsys):
    assert sft(tmp_path) == 0
    assert "--zero_stage 2 on one CPU rank runs as DeepSpeed's stage 0" in capsys.readouterr().out
    folder = tmp_path / "checkpoints" / "global_step2"
    assert (folder / "mp_rank_00_model_states.pt").exists() and not list(folder.glob("*optim_states.pt"))


@pytest.mark.slow
def test_resume_on_another_world_size_is_refused(tmp_path, sft, tiny_pretrain, sft_jsonl):
    """Today DeepSpeed failed deep in its ZeRO loader with a traceback."""
    assert sft(tmp_path) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl,
           "--save_path", str(tmp_path), *FLAGS, "--load_checkpoint", "--max_steps", "3"]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode != 0
    assert "written by 1 rank(s) and this run has 2" in result.stderr, result.stderr[-3000:]
    assert tags(tmp_path) == ["global_step2"]


def test_metrics_tensorboard_and_wandb_continue_at_the_resumed_step(tmp_path, sft, monkeypatch):
    """A crash after step 4 was logged, with step 2 the last checkpoint. Today metrics.jsonl then held
    steps 3 and 4 twice, and W&B started a new run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    track = ["--use_tensorboard", str(tmp_path / "tb"), "--use_wandb", "offline"]
    assert sft(tmp_path, "--max_steps", "4", "--save_steps", "2", *track) == 0
    shutil.rmtree(tmp_path / "checkpoints" / "global_step4")
    (tmp_path / "checkpoints" / "latest").write_text("global_step2")
    first = read_metrics(tmp_path)

    assert sft(tmp_path, "--max_steps", "4", "--save_steps", "2", "--load_checkpoint", *track) == 0
    resumed = read_metrics(tmp_path)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == first[:2]
    assert resumed[3]["loss"] == pytest.approx(first[3]["loss"], abs=1e-5)  # trained again, exactly
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    wandb_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(f"-{run_id}" in run.name for run in wandb_runs)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_pretrain, sft_jsonl):
    """A run with checkpoints at steps 1 and 2; each test damages a copy."""
    save_path = tmp_path_factory.mktemp("two_checkpoints")
    argv = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(save_path), *FLAGS,
            "--launcher", "local", "--save_steps", "1"]
    assert train_sft.main(argv) == 0
    return save_path


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    else:
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1:])


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_a_damaged_checkpoint_is_named_with_the_last_good_one(how, two_checkpoints, tmp_path, sft, capsys):
    """Today a truncated file failed in torch.load with a traceback, and a flipped byte loaded silently."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    # one CPU rank: DeepSpeed's stage 0, whose model-states file holds the weights and the optimizer state
    states = run / "checkpoints" / "global_step2" / "mp_rank_00_model_states.pt"
    damage(states, how)
    assert sft(run, "--load_checkpoint", "--max_steps", "3") == 2
    err = capsys.readouterr().err
    assert states.name in err and "global_step2" in err
    assert "--load_checkpoint --load_checkpoint_tag global_step1" in err
    assert sft(run, "--load_checkpoint_tag", "global_step1", "--max_steps", "3") == 0
    assert f"resumed from {run / 'checkpoints'} at step 1" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]


def test_latest_naming_a_missing_folder_is_a_message(two_checkpoints, tmp_path, sft, capsys):
    """Today DeepSpeed's loader ended the run with a bare error."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    shutil.rmtree(run / "checkpoints" / "global_step2")
    assert sft(run, "--load_checkpoint") == 2
    err = capsys.readouterr().err
    assert "latest names global_step2, but there is no such folder" in err
    assert "--load_checkpoint_tag global_step1" in err and "Traceback" not in err


def test_load_checkpoint_without_a_checkpoint_says_it_starts_from_step_0(tmp_path, sft, capsys):
    assert sft(tmp_path, "--load_checkpoint") == 0
    assert f"--load_checkpoint: no checkpoint in {tmp_path / 'checkpoints'}; starting from step 0" in \
        capsys.readouterr().out


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, sft, capsys, monkeypatch):
    """Today the OSError escaped the CLI as a traceback and left the half-written staging folder."""
    import torch

    save = torch.save

    def full_at_step_2(obj, f, *args, **kwargs):
        if ".global_step2.tmp" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_step_2)
    assert sft(tmp_path, "--save_steps", "1") != 0
    err = capsys.readouterr().err
    assert "no space left on device" in err and str(tmp_path / "checkpoints" / "global_step2") in err
    assert tags(tmp_path) == ["global_step1"] and latest(tmp_path) == "global_step1"
    assert verify(tmp_path / "checkpoints" / "global_step1") is None
    assert not list((tmp_path / "checkpoints").glob(".*tmp"))


@pytest.mark.slow
def test_a_full_disk_under_ray_reaches_the_user(tmp_path, tiny_pretrain, sft_jsonl):
    """A Ray worker's ENOSPC (injected by disk_full/sitecustomize.py, which Ray's workers import too)."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "OPENPACK_TEST_DISK_FULL_AT": ".global_step2.tmp",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "disk_full"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_sft", "--pretrain", tiny_pretrain,
                             "--dataset", sft_jsonl, "--save_path", str(tmp_path), *FLAGS, "--save_steps", "1",
                             "--num_gpus_per_node", "1", "--num_cpus_per_worker", "1"],
                            capture_output=True, text=True, timeout=HANG_S, env=env)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("openpack train_sft: no space left on device while writing checkpoint "
                           f"{tmp_path / 'checkpoints' / 'global_step2'}"), result.stderr[-3000:]
    assert "ray: rank 0 pid" in result.stdout  # it ran under Ray
    assert tags(tmp_path) == ["global_step1"] and latest(tmp_path) == "global_step1"
    assert verify(tmp_path / "checkpoints" / "global_step1") is None
    assert not (tmp_path / "run.lock").exists()
