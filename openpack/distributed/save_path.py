"""A save path belongs to one run: its identity (``run.json``), its lock (``run.lock``), and the errors a user acts on.

Before this, a new run into a folder holding another run's checkpoints with
higher step numbers pruned each of its own checkpoints as soon as it wrote
it, leaving ``latest`` naming a deleted folder, and two runs at once on one
folder overwrote each other without a word (issue 12). Now:

* A fresh run claims the folder: ``run.json`` holds its run id (also the W&B
  run id), when and on which host it started. A fresh run into a folder that
  holds another run's checkpoints or final model is refused before Ray,
  DeepSpeed or a model load start, naming the three ways on:
  ``--load_checkpoint`` (resume that run), another ``--save_path``, or
  ``--overwrite`` (delete its checkpoints and model, start anew). A folder
  whose run left neither (it stopped before its first checkpoint) is taken
  over with a notice: there is nothing in it to lose.
* The refusal is checked early, the claim is made late. The CLI checks
  (``check_free``) right after taking the lock, before a demo model trains or
  the data is planned; the claim itself (``claim``: write ``run.json``, and
  under ``--overwrite`` delete the old run's files) is made by the worker's
  rank 0 in ``TrainingRun``, after the model, the data and the engine are
  ready, so after every check. A run refused anywhere before that (a bad row,
  a model that does not load, an unreachable cluster) leaves the folder as it
  found it: before, its ``run.json`` made the next run report that the folder
  "belonged to run ..., which left no checkpoint or model" (issue 23), and a
  refused ``--overwrite`` run had already deleted the old run's checkpoints.
  The lock is held from the check to the end of the run, so nothing changes
  in between.
* The process that lives for the whole run (the CLI driver, also under
  ``--launcher local``; under torchrun or the deepspeed launcher, global rank
  0) holds ``run.lock`` (pid, host, start time) from before anything starts
  until it exits, exceptions and Ctrl-C included. It is created with
  ``O_EXCL``, so of two runs started together exactly one gets it; the other
  fails at once naming the holder. A lock whose process is gone from this
  host (dead pid, or the pid now belongs to a younger process) is taken over
  with a notice. A lock from another host cannot be checked and is never
  taken over: its message says how to remove it by hand.

Only small files are read and written here (no torch), so the driver can do
all of it before anything heavy starts.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
LATEST = "latest"
TAG_PREFIX = "global_step"
META_FILE = "openpack.json"  # inside a checkpoint: the run id, world size and config that wrote it


class CheckpointError(RuntimeError):
    """A save path or checkpoint problem the user must act on; the message names the path and the fix.

    The CLI prints it as one line and exits 2. Subclasses take one message string only, so they pickle
    and Ray re-raises a worker's error in the driver as itself.
    """


class SavePathTaken(CheckpointError):
    """A fresh run into a folder that holds another run's checkpoints or model."""


class SavePathLocked(CheckpointError):
    """Another live run holds the folder's lock."""


def checkpoint_dir(save_path, ckpt_path) -> Path:
    """``--ckpt_path``, or ``<save_path>/checkpoints``."""
    return Path(ckpt_path) if ckpt_path else Path(save_path) / "checkpoints"


def resumes(out_cfg) -> bool:
    """``--load_checkpoint``, or ``--load_checkpoint_tag`` (which names what to resume, so implies it)."""
    return bool(out_cfg.load_checkpoint or getattr(out_cfg, "load_checkpoint_tag", None))


def tag_step(tag: str) -> int | None:
    """``global_step12`` -> 12; None for any other name."""
    rest = tag[len(TAG_PREFIX):] if tag.startswith(TAG_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def checkpoint_tags(ckpt_dir) -> list[str]:
    """The checkpoint folders in ``ckpt_dir`` (complete or not), oldest step first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and tag_step(p.name) is not None]
    return sorted(tags, key=tag_step)


def read_json(path: Path) -> dict | None:
    """A small JSON object, or None when the file is absent or unreadable."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def checkpoint_run_id(folder: Path) -> str | None:
    """The run id a checkpoint folder was written by (None: written before run ids, or unreadable)."""
    return (read_json(Path(folder) / META_FILE) or {}).get("run_id")


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name in the same folder, then rename: a reader sees the old or the new text."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


@dataclass
class RunRecord:
    """``run.json``: which run a save path belongs to."""

    run_id: str  # 12 hex digits: also the W&B run id, so a resumed run continues the same W&B run
    created: str
    host: str

    def describe(self) -> str:
        return f"run {self.run_id} (started {self.created} on {self.host})"


def read_run(save_path) -> RunRecord | None:
    data = read_json(Path(save_path) / RUN_FILE)
    try:
        return RunRecord(**data) if data else None
    except TypeError:  # keys of another version: treat as an unknown run, not as no run
        return RunRecord(str(data.get("run_id", "unknown")), str(data.get("created", "?")), str(data.get("host", "?")))


def _new_record(run_id: str | None = None) -> RunRecord:
    return RunRecord(run_id or uuid.uuid4().hex[:12], _now(), socket.gethostname())


def check_free(save_path, ckpt_dir, resume: bool, overwrite: bool) -> None:
    """Refuse a fresh run into a folder that holds another run's checkpoints or model (``SavePathTaken``).

    Reads only: the CLI calls it under the lock before anything starts, ``claim`` again when it claims.
    """
    save_path, ckpt_dir = Path(save_path), Path(ckpt_dir)
    if resume or overwrite:
        return
    tags, model = checkpoint_tags(ckpt_dir), save_path / "model"
    if tags or model.is_dir():
        raise SavePathTaken(_taken_message(save_path, ckpt_dir, read_run(save_path), tags, model.is_dir()))


def claim(save_path, ckpt_dir, resume: bool, overwrite: bool, say=print) -> RunRecord:
    """Make ``save_path`` this run's (see the module docstring); returns its record.

    ``resume`` adopts the run that is there (its run id; a folder without ``run.json`` takes the id of
    its newest checkpoint). ``overwrite`` is for a fresh run only: with ``resume`` it is ignored.
    Called once every check has passed (``TrainingRun``), as it writes and, under ``overwrite``, deletes.
    """
    save_path, ckpt_dir = Path(save_path), Path(ckpt_dir)
    record = read_run(save_path)
    if resume:
        if record is None:
            tags = checkpoint_tags(ckpt_dir)
            record = _new_record(checkpoint_run_id(ckpt_dir / tags[-1]) if tags else None)
            _write_run(save_path, record)
        return record
    check_free(save_path, ckpt_dir, resume, overwrite)
    tags, model = checkpoint_tags(ckpt_dir), save_path / "model"
    if tags or model.is_dir():  # only under overwrite, after check_free
        _clear(ckpt_dir, tags, model)
        say(f"openpack: --overwrite: deleted the checkpoints ({', '.join(tags) or 'none'}) and model of "
            f"{record.describe() if record else 'the run'} in {save_path}")
    elif record is not None:
        say(f"openpack: {save_path} belonged to {record.describe()}, which left no checkpoint or model; "
            "starting a new run there")
    record = _new_record()
    _write_run(save_path, record)
    return record


def _taken_message(save_path: Path, ckpt_dir: Path, record: RunRecord | None, tags: list[str], model: bool) -> str:
    whose = record.describe() if record else "another run"
    held = f"checkpoints up to {tags[-1]} in {ckpt_dir}" if tags else f"a final model in {save_path / 'model'}"
    resume = "--load_checkpoint to resume it, " if tags else ""
    return (f"--save_path {save_path} holds {held} of {whose}; a new run there would delete or mix with them. "
            f"Pass {resume}another --save_path, or --overwrite to delete {'them' if tags else 'it'} and start anew")


def _clear(ckpt_dir: Path, tags: list[str], model: Path) -> None:
    """The old run's checkpoints (complete, staging, ``latest``) and final model; nothing else is touched."""
    for tag in tags:
        shutil.rmtree(ckpt_dir / tag)
    for staging in ckpt_dir.glob(f".{TAG_PREFIX}*.tmp") if ckpt_dir.is_dir() else []:
        shutil.rmtree(staging, ignore_errors=True)
    (ckpt_dir / LATEST).unlink(missing_ok=True)
    shutil.rmtree(model, ignore_errors=True)


def _write_run(save_path: Path, record: RunRecord) -> None:
    save_path.mkdir(parents=True, exist_ok=True)
    write_text_atomic(save_path / RUN_FILE, json.dumps(asdict(record), indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- the lock


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22): tells a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    try:  # a zombie has exited; only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stale(holder: dict) -> bool:
    """The holder ran on this host and is gone (dead pid, or the pid now names a process started later)."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return True
    started = holder.get("process_start")
    return started is not None and _process_start(pid) not in (None, started)


def _read_lock(path: Path) -> dict | None:
    """The holder's record; {} for a lock that stays empty (its writer died between create and write)."""
    for _ in range(10):  # the window between O_EXCL create and the write is microseconds
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        if text.strip():
            try:
                return json.loads(text)
            except ValueError:
                return {}
        time.sleep(0.1)
    return {}


def _describe_holder(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _acquire(path: Path, mine: dict, say) -> None:
    for _ in range(5):  # each pass either takes the lock, fails, or removes one stale lock
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:  # released meanwhile
                continue
            if holder and not _stale(holder):
                raise SavePathLocked(
                    f"--save_path {path.parent} is in use by another openpack run: {_describe_holder(holder)} "
                    f"(lock {path}). Wait for it to finish or use another --save_path; if that run is gone "
                    "(e.g. on another host), delete the lock file")
            # Move the stale lock aside before deleting it, and only if it is still the one judged stale:
            # two runs taking over at once must not delete each other's fresh lock.
            aside = path.with_name(f".{path.name}.stale-{os.getpid()}")
            try:
                os.replace(path, aside)
            except FileNotFoundError:
                continue
            if _read_lock(aside) != holder:
                os.replace(aside, path)
                continue
            aside.unlink()
            say(f"openpack: took over the stale lock {path} of "
                f"{_describe_holder(holder) if holder else 'a run that died while taking it'} (no longer running)")
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(mine) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return
    raise SavePathLocked(f"could not take the lock {path}: other runs keep taking it; is something restarting runs "
                         "in a loop?")


@contextlib.contextmanager
def locked(save_path, say=print):
    """Hold ``<save_path>/run.lock`` for the ``with`` block (released on any exit, exceptions and Ctrl-C included)."""
    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    path = save_path / LOCK_FILE
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
            "process_start": _process_start(os.getpid()), "token": uuid.uuid4().hex}
    _acquire(path, mine, say)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if (read_json(path) or {}).get("token") == mine["token"]:  # never remove a lock taken over from us
                path.unlink()


@contextlib.contextmanager
def own_save_path(out_cfg, launched_by_environment: bool, say=print):
    """The CLI's hold on ``--save_path`` for the whole run: lock it, then refuse it if another run's files are there.

    It does not claim: the worker's rank 0 does, once every check has passed (module docstring), so a run
    refused before then leaves no ``run.json`` and deletes nothing. Under torchrun or the deepspeed launcher
    every process runs the CLI; global rank 0 alone takes the lock and checks.
    """
    if launched_by_environment and os.environ.get("RANK", "0") != "0":
        yield
        return
    with locked(out_cfg.save_path, say):
        check_free(out_cfg.save_path, checkpoint_dir(out_cfg.save_path, out_cfg.ckpt_path), resumes(out_cfg),
                   getattr(out_cfg, "overwrite", False))
        yield
