"""A save path belongs to one run: run.json claims it, run.lock keeps a second run out (issue 12)."""

import json
import socket
import subprocess
import sys

import pytest

from openpack.distributed.save_path import (LOCK_FILE, RUN_FILE, SavePathLocked, SavePathTaken, check_free, claim,
                                            locked, read_run)


def lock_of(pid, host=None):
    return json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "2026-11-23T10:00:00+00:00"})


def fake_checkpoint(ckpt, step, run_id="other"):
    folder = ckpt / f"global_step{step}"
    folder.mkdir(parents=True)
    (folder / "openpack.json").write_text(json.dumps({"run_id": run_id}))
    (ckpt / "latest").write_text(folder.name)


def test_a_fresh_run_claims_an_empty_folder(tmp_path):
    record = claim(tmp_path / "run", tmp_path / "run" / "checkpoints", resume=False, overwrite=False)
    assert read_run(tmp_path / "run") == record
    assert len(record.run_id) == 12 and record.host == socket.gethostname()


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_with_the_three_ways_on(tmp_path):
    ckpt = tmp_path / "checkpoints"
    fake_checkpoint(ckpt, 6)
    with pytest.raises(SavePathTaken) as err:
        claim(tmp_path, ckpt, resume=False, overwrite=False)
    message = str(err.value)
    assert "global_step6" in message and "\n" not in message
    for way in ("--load_checkpoint", "another --save_path", "--overwrite"):
        assert way in message
    assert (ckpt / "global_step6").is_dir()  # refused: nothing touched


def test_the_early_check_refuses_as_the_claim_does_but_writes_and_deletes_nothing(tmp_path):
    """The CLI checks before anything starts and the worker claims after every check (issue 23): the check alone
    must leave a folder as it found it, --overwrite included."""
    ckpt = tmp_path / "checkpoints"
    fake_checkpoint(ckpt, 6)
    with pytest.raises(SavePathTaken, match="global_step6"):
        check_free(tmp_path, ckpt, resume=False, overwrite=False)
    check_free(tmp_path, ckpt, resume=False, overwrite=True)
    check_free(tmp_path / "empty", tmp_path / "empty" / "checkpoints", resume=False, overwrite=False)
    assert (ckpt / "global_step6").is_dir() and not (tmp_path / RUN_FILE).exists()
    assert not (tmp_path / "empty").exists()


def test_a_final_model_alone_also_belongs_to_its_run(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(SavePathTaken, match="final model"):
        claim(tmp_path, tmp_path / "checkpoints", resume=False, overwrite=False)


def test_overwrite_deletes_the_old_runs_checkpoints_and_model_only(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    fake_checkpoint(ckpt, 2)
    (ckpt / ".global_step3.tmp").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    old = claim(tmp_path / "elsewhere", tmp_path / "elsewhere", resume=False, overwrite=False)
    (tmp_path / RUN_FILE).write_text((tmp_path / "elsewhere" / RUN_FILE).read_text())
    new = claim(tmp_path, ckpt, resume=False, overwrite=True)
    assert new.run_id != old.run_id
    assert list(ckpt.iterdir()) == [] and not (tmp_path / "model").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert f"run {old.run_id}" in capsys.readouterr().out


def test_resume_adopts_the_run_and_its_id(tmp_path):
    ckpt = tmp_path / "checkpoints"
    fake_checkpoint(ckpt, 4, run_id="abc123abc123")
    assert claim(tmp_path, ckpt, resume=True, overwrite=True).run_id == "abc123abc123"  # overwrite ignored
    assert (ckpt / "global_step4").is_dir()
    assert read_run(tmp_path).run_id == "abc123abc123"


def test_a_run_that_left_nothing_is_taken_over_with_a_notice(tmp_path, capsys):
    first = claim(tmp_path, tmp_path / "checkpoints", resume=False, overwrite=False)
    second = claim(tmp_path, tmp_path / "checkpoints", resume=False, overwrite=False)
    assert second.run_id != first.run_id
    assert "left no checkpoint or model" in capsys.readouterr().out


def test_the_lock_is_held_inside_and_released_after_even_on_error(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with locked(tmp_path):
            holder = json.loads((tmp_path / LOCK_FILE).read_text())
            assert holder["pid"] == __import__("os").getpid() and holder["host"] == socket.gethostname()
            raise KeyboardInterrupt
    assert not (tmp_path / LOCK_FILE).exists()


HOLD = """
import sys, time
from openpack.distributed.save_path import locked
with locked(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_process_fails_at_once_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SavePathLocked) as err:  # at once: waiting would have ended only with the holder
            with locked(tmp_path):
                pass
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed (no cleanup ran): its lock is stale now and is taken over
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    with locked(tmp_path, say=lambda _: None):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] != holder.pid


def test_a_stale_lock_is_taken_over_with_a_notice(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(lock_of(dead.pid))
    with locked(tmp_path):
        pass
    out = capsys.readouterr().out
    assert "took over the stale lock" in out and f"pid {dead.pid}" in out
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_reused_pid_is_stale_too(tmp_path):
    """The pid is alive (this process), but the lock recorded another process start: the pid was reused."""
    holder = json.loads(lock_of(__import__("os").getpid()))
    (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "process_start": "1"}))
    with locked(tmp_path, say=lambda _: None):
        pass


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(lock_of(1, host="some-other-node"))
    with pytest.raises(SavePathLocked, match="some-other-node.*delete the lock file"):
        with locked(tmp_path):
            pass
    assert (tmp_path / LOCK_FILE).exists()
