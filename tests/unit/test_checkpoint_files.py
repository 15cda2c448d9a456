"""Checkpoint folders without DeepSpeed: manifest, verification, pruning by run, resume checks, a full disk."""

import errno
import json

import pytest

from openpack.distributed import checkpoint
from openpack.distributed.checkpoint import (CheckpointDamaged, DiskFull, ResumeMismatch, RunState, check_resumable,
                                             open_checkpoint, prune, verify, write_manifest)


def fake_checkpoint(ckpt, step, run_id="me", steps_order=None):
    """A folder shaped like a written checkpoint: two data files, openpack.json, data_order.json, manifest."""
    folder = ckpt / f"global_step{step}"
    (folder / "hf_model").mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 40)
    (folder / "hf_model" / "model.safetensors").write_bytes(b"weights" * 100)
    (folder / "openpack.json").write_text(json.dumps({"run_id": run_id, "step": step, "world_size": 1, "config": {}}))
    (folder / "data_order.json").write_text(json.dumps(steps_order or [f"d{i}" for i in range(step)]))
    write_manifest(folder)
    (ckpt / "latest").write_text(folder.name)
    return folder


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    folder = fake_checkpoint(tmp_path, 1)
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(files) == ["data_order.json", "hf_model/model.safetensors", "mp_rank_00_model_states.pt",
                             "openpack.json"]
    assert files["mp_rank_00_model_states.pt"]["size"] == 10240 and len(files["openpack.json"]["sha256"]) == 64
    assert verify(folder) is None


def test_truncated_flipped_missing_and_unmanifested_files_are_named(tmp_path):
    folder = fake_checkpoint(tmp_path, 1)
    data = folder / "mp_rank_00_model_states.pt"
    original = data.read_bytes()
    data.write_bytes(original[:100])
    assert verify(folder) == "mp_rank_00_model_states.pt is 100 bytes, its manifest says 10240 (truncated?)"
    data.write_bytes(original[:5000] + bytes([original[5000] ^ 1]) + original[5001:])
    assert "mp_rank_00_model_states.pt does not match its sha256" in verify(folder)
    data.unlink()
    assert verify(folder) == "mp_rank_00_model_states.pt is missing"
    (folder / "manifest.json").unlink()
    assert "no readable manifest.json" in verify(folder)


def test_a_damaged_checkpoint_names_the_newest_that_verifies(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6)
    for step in (6, 4):
        (tmp_path / f"global_step{step}" / "hf_model" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointDamaged) as err:
        open_checkpoint(tmp_path)
    message = str(err.value)
    assert "global_step6" in message and "hf_model/model.safetensors is 1 bytes" in message
    assert "--load_checkpoint --load_checkpoint_tag global_step2" in message
    folder, state = open_checkpoint(tmp_path, "global_step2")
    assert folder.name == "global_step2" and state.run_id == "me" and state.data_order == ["d0", "d1"]


def test_latest_naming_a_missing_folder_is_a_message(tmp_path):
    fake_checkpoint(tmp_path, 2)
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(CheckpointDamaged, match="latest names global_step9, but there is no such folder.*"
                                                "--load_checkpoint_tag global_step2"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointDamaged, match="no folder .*global_step7 .*checkpoints there: global_step2"):
        open_checkpoint(tmp_path, "global_step7")


def test_nothing_to_resume_is_none(tmp_path):
    assert open_checkpoint(tmp_path / "nowhere") is None
    assert open_checkpoint(tmp_path) is None


def test_pruning_keeps_this_runs_newest_and_never_touches_another_runs(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step, run_id="me")
    for step in (5, 9):
        fake_checkpoint(tmp_path, step, run_id="someone else")  # higher steps: today they won every prune
    fake_checkpoint(tmp_path, 7, run_id="me")  # this run's own later one, left by a resume from an older tag
    prune(tmp_path, keep=2, run_id="me", step=3)
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step2", "global_step3", "global_step5",
                                                                      "global_step7", "global_step9"]


def state(order, world_size=1, **config):
    return RunState("me", world_size, {"train_batch_size": 8, "max_steps": 2, "zero_stage": 2, **config}, order)


def test_a_resume_with_the_same_first_steps_is_exact_and_reports_what_changed():
    saved = state(["a", "b"])
    assert check_resumable("ckpt", saved, state(["a", "b", "c"], max_steps=3), 2) == {"max_steps": (2, 3)}
    assert check_resumable("ckpt", saved, state(["a", "b"], load_checkpoint=True, logging_steps=5), 2) == {}


def test_a_resume_that_would_skip_samples_is_refused_listing_the_settings():
    with pytest.raises(ResumeMismatch, match=r"from step 1 on.*train_batch_size 8 -> 16"):
        check_resumable("ckpt", state(["a", "b"]), state(["x", "y"], train_batch_size=16), 2)
    with pytest.raises(ResumeMismatch, match="plans only 1 steps"):
        check_resumable("ckpt", state(["a", "b"]), state(["a"], max_steps=1), 2)


def test_another_world_size_or_zero_stage_is_refused():
    with pytest.raises(ResumeMismatch, match=r"written by 1 rank\(s\) and this run has 2"):
        check_resumable("ckpt", state(["a"]), state(["a"], world_size=2), 1)
    with pytest.raises(ResumeMismatch, match="zero_stage 2 -> 3"):
        check_resumable("ckpt", state(["a"]), state(["a"], zero_stage=3), 1)


def test_another_ring_attn_size_is_refused_naming_both():
    """--ring_attn_size decides the data-parallel plan (world / N ranks): refused in one line even where the digests
    could agree; unset (an older run, or no flag) is 1."""
    with pytest.raises(ResumeMismatch, match=r"written with --ring_attn_size 2 and this run has --ring_attn_size 1") \
            as refused:
        check_resumable("ckpt", state(["a"], 2, ring_attn_size=2), state(["a"], 2, ring_attn_size=None), 1)
    assert "\n" not in str(refused.value) and "Resume with --ring_attn_size 2" in str(refused.value)
    with pytest.raises(ResumeMismatch, match=r"--ring_attn_size 1 and this run has --ring_attn_size 2"):
        check_resumable("ckpt", state(["a"], 2), state(["a"], 2, ring_attn_size=2), 1)
    assert check_resumable("ckpt", state(["a"], 2, ring_attn_size=2), state(["a"], 2, ring_attn_size=2), 1) == {}
    assert check_resumable("ckpt", state(["a"]), state(["a"], ring_attn_size=1), 1) == {"ring_attn_size": (None, 1)}


def test_other_lora_adapters_are_refused_naming_the_flag_both_values_and_the_fix():
    lora = dict(lora_rank=8, lora_alpha=16, target_modules=["all-linear"], load_in_4bit=False)
    with pytest.raises(ResumeMismatch, match=r"\(--lora_rank 8 -> 0\).*Resume with --lora_rank 8, or"):
        check_resumable("ckpt", state(["a"], **lora), state(["a"], **{**lora, "lora_rank": 0}), 1)
    with pytest.raises(ResumeMismatch, match=r"\(--load_in_4bit -> --no_load_in_4bit\).*Resume with --load_in_4bit,"):
        check_resumable("ckpt", state(["a"], **{**lora, "load_in_4bit": True}), state(["a"], **lora), 1)
    with pytest.raises(ResumeMismatch, match=r"\(--lora_rank 0 -> 8\)"):  # a checkpoint from before LoRA
        check_resumable("ckpt", state(["a"]), state(["a"], **lora), 1)
    # no adapters on either side: the LoRA-only flags change nothing; the same targets in another order are the same
    assert check_resumable("ckpt", state(["a"], lora_rank=0, lora_alpha=16), state(["a"], lora_rank=0, lora_alpha=32),
                           1) == {"lora_alpha": (16, 32)}
    pair = [{**lora, "target_modules": ["q_proj", "v_proj"]}, {**lora, "target_modules": ["v_proj", "q_proj"]}]
    assert checkpoint.lora_changes(*pair) == {}
    assert checkpoint.lora_changes(lora, {**lora, "target_modules": None, "lora_dropout": 0.1}) == {}


def test_disk_full_is_recognised_with_or_without_an_errno(tmp_path, monkeypatch):
    assert checkpoint._is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert checkpoint._is_disk_full(RuntimeError("I/O error: No space left on device (os error 28)"), tmp_path)
    wrapped = RuntimeError("PytorchStreamWriter failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert checkpoint._is_disk_full(wrapped, tmp_path)
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not checkpoint._is_disk_full(torch_save, tmp_path)  # a failure on a disk with room is not "disk full"
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: type("U", (), {"free": 4096})())
    assert checkpoint._is_disk_full(torch_save, tmp_path / "not" / "yet")  # torch.save's way of saying it


def test_disk_full_error_removes_staging_and_pickles(tmp_path):
    import pickle

    staging = tmp_path / ".global_step2.tmp"
    staging.mkdir()
    with pytest.raises(DiskFull) as err:
        with checkpoint._disk_full_is_an_error(tmp_path / "global_step2", staging, "checkpoint", "all is well"):
            raise OSError(errno.ENOSPC, "No space left on device", str(staging / "x.pt"))
    assert not staging.exists()
    assert str(err.value).startswith(f"no space left on device while writing checkpoint {tmp_path / 'global_step2'}")
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)


def test_saving_a_model_built_in_memory_prints_no_progress_bar(tmp_path, capfd):
    """The SFT demo's model is built from a config, never loaded, so nothing had turned transformers' bars off
    before its save: "Writing model shards" bars reached the console through Ray (issue 24, item 3)."""
    from types import SimpleNamespace

    from transformers.utils import logging as hf_logging

    from openpack.models.tiny import tiny_causal_lm

    engine = SimpleNamespace(module=SimpleNamespace(model=tiny_causal_lm("llama", seed=0)),
                             zero_optimization_stage=lambda: 0)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        checkpoint.save_hf_model(engine, None, tmp_path / "model", is_main=True)
    finally:  # transformers' switch is process-wide: leave it as the test found it
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
    assert (tmp_path / "model" / "config.json").exists()
    assert "Writing model shards" not in capfd.readouterr().err
