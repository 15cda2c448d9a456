"""Checkpoints that survive a crash or a full disk at any moment, are verified on load, and resume exactly.

Layout under ``ckpt_path``::

    global_step4/            one DeepSpeed checkpoint (model, optimizer, scheduler; the trainer's
                             position - epoch, step - in DeepSpeed's client state)
        rng_rank{r}.pt       each rank's Python, NumPy and torch RNG states
        hf_model/            the same weights as a Hugging Face folder (from_pretrained loads it)
        openpack.json        the run id, world size and effective config of the run that wrote it
        data_order.json      a digest of the samples of every step taken (``RankStep.digest``)
        manifest.json        every other file's size and sha256, written last: no manifest, no checkpoint
    latest                   the tag of the newest complete checkpoint

Saving: every rank writes into ``.global_step4.tmp``; once all are done,
rank 0 writes the manifest, renames the folder into place and replaces
``latest`` atomically, so a crash mid-write leaves the previous checkpoint as
the latest. A full disk (ENOSPC) removes the staging folder and raises
``DiskFull``, naming the path, with the previous checkpoint and ``latest``
untouched. Pruning keeps the newest ``max_ckpt_num`` checkpoints of this run
(by the run id in ``openpack.json``): another run's checkpoints, and the one
just written, are never deleted.

Loading verifies every file against the manifest first. Rank 0 hashes with up
to 8 threads, on save and on load, while the other ranks wait: sha256 ran at
1.0 GB/s per core here (AMD EPYC, 2026-11-23), so about 13 s for a 100 GB
checkpoint on 8 cores if the disk keeps up, against minutes to write it. A
truncated or changed file is named, with the newest checkpoint that does
verify and the flag to resume from it (``--load_checkpoint_tag``). Before
DeepSpeed loads anything, the checkpoint's world size, ZeRO stage, precision,
LoRA adapters and data order are compared with the new run's
(``check_resumable``), and its optimizer files with the engine's ZeRO stage
(``check_optimizer_layout``), so a resume either continues exactly or is
refused with the settings that differ.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from openpack.distributed.nonfinite import refuse_nonfinite
from openpack.distributed.process import barrier
from openpack.distributed.save_path import (LATEST, META_FILE, TAG_PREFIX, CheckpointError, checkpoint_run_id,
                                            checkpoint_tags, read_json, tag_step, write_text_atomic)

MANIFEST = "manifest.json"
DATA_ORDER = "data_order.json"

T = TypeVar("T")


class CheckpointDamaged(CheckpointError):
    """A checkpoint that is missing, incomplete or whose bytes differ from its manifest."""


class ResumeMismatch(CheckpointError):
    """The new run would not continue the checkpoint's run exactly (other data order, world size, layout)."""


class DiskFull(CheckpointError):
    """No space left on the device while writing a checkpoint or the final model."""


@dataclass
class RunState:
    """What a checkpoint records about the run that wrote it (rank 0's view; the same on every rank)."""

    run_id: str
    world_size: int
    config: dict = field(default_factory=dict)  # the effective config.yaml, as a dict; {} when unknown
    data_order: list[str] = field(default_factory=list)  # RankStep.digest of each step taken, in order


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def decided_by_main(decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0; its result, or the CheckpointError it raised, on every rank.

    Verifying a checkpoint and judging a resume read files once, on rank 0; every rank must then take
    the same way (load, or fail with the same message) or the others would wait in a collective forever.
    """
    initialized = torch.distributed.is_initialized()
    outcome: list = [None]
    if not initialized or torch.distributed.get_rank() == 0:
        try:
            outcome[0] = (True, decide())
        except CheckpointError as err:
            outcome[0] = (False, err)
    if initialized and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


# ------------------------------------------------------------------------------------------ disk full

_NEARLY_FULL = 16 << 20  # bytes free below which a failed write is taken for a full disk


def _is_disk_full(err: BaseException, path: Path) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception chain, or a failed write on a filesystem that is now full.

    The second case is torch.save to a path: its C++ writer reports a full disk as a RuntimeError
    ("unexpected pos ...") with no errno, measured on a 2 MB tmpfs.
    """
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "no space left on device" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free < _NEARLY_FULL
    except OSError:
        return False


@contextlib.contextmanager
def _disk_full_is_an_error(target: Path, staging: Path, what: str, intact: str) -> Iterator[None]:
    """Turn a full disk while writing ``staging`` (to become ``target``) into DiskFull; remove ``staging``."""
    try:
        yield
    except Exception as err:
        if not (isinstance(err, DiskFull) or _is_disk_full(err, staging)):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # before the message: the previous checkpoint stays the latest
        cause = err.__cause__ if isinstance(err, DiskFull) and err.__cause__ is not None else err  # a nested save
        raise DiskFull(f"no space left on device while writing {what} {target} ({type(cause).__name__}: "
                       f"{str(cause).strip()[:200]}); {intact}. Free space there (or point --ckpt_path / --save_path "
                       "at another disk) and rerun with --load_checkpoint") from cause


# ------------------------------------------------------------------------------------------- saving


def save_hf_model(engine, tokenizer, out_dir: Path, is_main: bool, adapter_dir: Path | None = None) -> None:
    """Write engine.module.model as a Hugging Face folder, atomically (ZeRO-3 parameters gathered).

    A LoRA model is written merged (base + adapters, loadable without peft) and, with ``adapter_dir``, its
    adapter alone there too (peft's ``PeftModel.from_pretrained`` folder).
    """
    import deepspeed

    from openpack.models import lora
    from openpack.models.loading import quiet_progress_bars

    quiet_progress_bars()  # "Writing model shards" bars, for a model no --pretrain load has quietened (the demos')
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    model = engine.module.model
    adapter_dir = Path(adapter_dir) if adapter_dir is not None and lora.is_lora(model) else None
    adapter_tmp = adapter_dir.with_name(f".{adapter_dir.name}.tmp") if adapter_dir else None
    params = list(model.parameters())
    intact = f"{out_dir} is as it was" if out_dir.exists() else f"nothing was written to {out_dir}"
    refuse_nonfinite(model, f"the model {out_dir} ({intact})")
    with _disk_full_is_an_error(out_dir, tmp, "the model", intact):
        with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                if lora.is_lora(model):
                    lora.save_merged(model, tmp)
                else:
                    model.save_pretrained(tmp, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if adapter_dir:
                    shutil.rmtree(adapter_tmp, ignore_errors=True)
                    model.save_pretrained(adapter_tmp, safe_serialization=True)
        if is_main:
            replace_dir(tmp, out_dir)
            if adapter_dir:
                replace_dir(adapter_tmp, adapter_dir)
    barrier()


def replace_dir(tmp: Path, final: Path) -> None:
    """``final`` becomes the complete folder ``tmp`` (the old one moved aside first, then deleted)."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(engine, tokenizer, ckpt_path, step: int, client_state: dict, max_ckpt_num: int, is_main: bool,
                    state: RunState, companions: dict | None = None) -> Path:
    """DeepSpeed checkpoint + HF folder + manifest for ``step``; returns its directory. ``companions`` are other
    engines trained alongside (``name -> engine``, e.g. PPO's critic), each saved in its own subfolder."""
    ckpt_path = Path(ckpt_path)
    tag = f"{TAG_PREFIX}{step}"
    staging = ckpt_path / f".{tag}.tmp"
    previous = read_latest(ckpt_path)
    intact = f"the previous checkpoint {ckpt_path / previous} is intact" if previous else "no earlier checkpoint exists"
    for name, module in (("", engine.module), *((f" ({name})", c.module) for name, c in (companions or {}).items())):
        refuse_nonfinite(module, f"checkpoint {ckpt_path / tag}{name} ({intact})")
    with _disk_full_is_an_error(ckpt_path / tag, staging, "checkpoint", intact):
        if is_main:
            ckpt_path.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        barrier()
        engine.save_checkpoint(str(ckpt_path), tag=staging.name, client_state=client_state, save_latest=False)
        for name, companion in (companions or {}).items():
            companion.save_checkpoint(str(staging), tag=name, save_latest=False)
        torch.save(rng_state(), staging / f"rng_rank{torch.distributed.get_rank()}.pt")
        save_hf_model(engine, tokenizer, staging / "hf_model", is_main)  # ends with a barrier: every rank wrote
        if is_main:
            meta = {"run_id": state.run_id, "step": step, "world_size": state.world_size, "config": state.config}
            write_text_atomic(staging / META_FILE, json.dumps(meta, indent=1) + "\n")
            write_text_atomic(staging / DATA_ORDER, json.dumps(state.data_order) + "\n")
            write_manifest(staging)
            replace_dir(staging, ckpt_path / tag)
            write_text_atomic(ckpt_path / LATEST, tag)
            prune(ckpt_path, max_ckpt_num, state.run_id, step)
    barrier()
    return ckpt_path / tag


def prune(ckpt_path: Path, keep: int, run_id: str, step: int) -> None:
    """Keep the newest ``keep`` checkpoints of run ``run_id`` up to ``step`` (the one just written).

    Another run's checkpoints are never touched, nor this run's later ones (left by a resume from an
    older tag: they are replaced when the run gets there again).
    """
    ours = [t for t in checkpoint_tags(ckpt_path) if tag_step(t) < step and checkpoint_run_id(ckpt_path / t) == run_id]
    for old in ours[:max(0, len(ours) - (keep - 1))]:
        shutil.rmtree(ckpt_path / old, ignore_errors=True)


# ------------------------------------------------------------------------------------------ manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)  # hashlib releases the GIL on large buffers: threads hash in parallel
    return digest.hexdigest()


def _hash_all(folder: Path, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda name: _sha256(folder / name), names))


def write_manifest(folder: Path) -> None:
    """``manifest.json``: relative path -> size and sha256 of every other file in ``folder``, written last."""
    folder = Path(folder)
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    files = {name: {"size": (folder / name).stat().st_size, "sha256": digest}
             for name, digest in zip(names, _hash_all(folder, names))}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify(folder: Path) -> str | None:
    """None when every file in the manifest is there with its size and sha256; else what is wrong, in words."""
    folder = Path(folder)
    if not folder.is_dir():
        return "the folder does not exist"
    manifest = read_json(folder / MANIFEST)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return (f"it has no readable {MANIFEST}: it is incomplete, or was written before openpack checkpoints "
                "had manifests")
    files = manifest["files"]
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} is {size} bytes, its manifest says {entry['size']} (truncated?)"
    names = list(files)
    for name, digest in zip(names, _hash_all(folder, names)):
        if digest != files[name]["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST} (its bytes changed on disk)"
    return None


# ------------------------------------------------------------------------------------------- loading


def read_latest(ckpt_path) -> str | None:
    latest = Path(ckpt_path) / LATEST
    return latest.read_text().strip() or None if latest.exists() else None


def _newest_good(ckpt_path: Path, besides: str | None) -> str | None:
    for tag in reversed(checkpoint_tags(ckpt_path)):
        if tag != besides and verify(ckpt_path / tag) is None:
            return tag
    return None


def _damaged(ckpt_path: Path, tag: str, problem: str) -> CheckpointDamaged:
    good = _newest_good(ckpt_path, besides=tag)
    if good is not None:
        way = (f"The newest checkpoint that verifies is {good}: resume from it with "
               f"--load_checkpoint --load_checkpoint_tag {good}")
    else:
        way = f"No other checkpoint in {ckpt_path} verifies: start anew with --overwrite (or another --save_path)"
    return CheckpointDamaged(f"cannot resume from checkpoint {ckpt_path / tag}: {problem}. {way}")


def open_checkpoint(ckpt_path, tag: str | None = None) -> tuple[Path, RunState] | None:
    """The verified checkpoint to resume from (``tag``, else the one ``latest`` names) and its RunState.

    None when there is none to resume (no ``latest`` and no checkpoint folder). Raises CheckpointDamaged
    for a missing, incomplete or changed one, naming the newest checkpoint that verifies.
    """
    ckpt_path = Path(ckpt_path)
    tags = checkpoint_tags(ckpt_path)
    if tag is not None and tag not in tags:
        there = ", ".join(tags) or "none"
        raise CheckpointDamaged(f"--load_checkpoint_tag {tag}: there is no folder {ckpt_path / tag} "
                                f"(checkpoints there: {there})")
    if tag is None:
        tag = read_latest(ckpt_path)
        if tag is None:
            if not tags:
                return None
            # no `latest` but checkpoints: a crash right after the very first rename; the newest is complete
            tag = tags[-1]
        elif tag not in tags:
            raise _damaged(ckpt_path, tag, f"{ckpt_path / LATEST} names {tag}, but there is no such folder")
    problem = verify(ckpt_path / tag)
    if problem is not None:
        raise _damaged(ckpt_path, tag, problem)
    meta = read_json(ckpt_path / tag / META_FILE) or {}
    order = json.loads((ckpt_path / tag / DATA_ORDER).read_text())
    return ckpt_path / tag, RunState(meta.get("run_id", ""), int(meta.get("world_size", 0)), meta.get("config", {}),
                                     order)


# Settings that say where and how a run logs, saves or is launched, never what it trains: a resume
# may change them freely and they are not listed as changes.
NOT_TRAINING = frozenset({"save_path", "ckpt_path", "save_steps", "max_ckpt_num", "load_checkpoint",
                          "load_checkpoint_tag", "overwrite", "logging_steps", "use_wandb", "wandb_project",
                          "wandb_run_name", "use_tensorboard", "launcher", "ray_address", "num_cpus_per_worker",
                          "eval_prompt_data", "eval_steps", "eval_n_samples_per_prompt", "eval_temperature",
                          "eval_pass_threshold", "best_metric_key"})
# Settings that change the layout of DeepSpeed's saved optimizer state: it cannot load across them.
LAYOUT = ("zero_stage", "bf16")
# LoRA settings that decide which adapters exist and what they add: a checkpoint's adapter weights and their
# optimizer state fit only its own (DeepSpeed's load_state_dict fails on other names or shapes), and another
# --lora_alpha would rescale what the adapters learned. Compared only when a side has adapters (--lora_rank > 0).
LORA = ("lora_rank", "lora_alpha", "target_modules", "load_in_4bit")


def changed_settings(saved: dict, now: dict) -> dict[str, tuple]:
    """``{key: (saved, now)}`` for every training setting that differs (a key one side lacks counts, except a key
    only ``now`` has at None or False: a flag newer than the saved run, off, as that run was)."""
    keys = [k for k in {**saved, **now} if k not in NOT_TRAINING and (k in saved or now[k] not in (None, False))]
    return {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}


def _listed(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())


def lora_changes(saved: dict, now: dict) -> dict[str, tuple]:
    """``{key: (saved, now)}`` for the ``LORA`` settings that differ: the rank alone when a side has no adapters
    (0, or no key in an older checkpoint), every one when both have; ``--target_modules`` compare as sets."""
    ranks = saved.get("lora_rank") or 0, now.get("lora_rank") or 0
    if not (ranks[0] and ranks[1]):
        return {"lora_rank": ranks} if ranks[0] != ranks[1] else {}
    normal = {"target_modules": lambda v: sorted(set(v or ["all-linear"])), "load_in_4bit": bool}

    def same(key: str) -> bool:
        as_is = normal.get(key, lambda v: v)
        return as_is(saved.get(key)) == as_is(now.get(key))

    return {k: (saved.get(k), now.get(k)) for k in LORA if not same(k)}


def _as_flag(key: str, value) -> str:
    """A setting as it is typed: ``--lora_rank 8``, ``--target_modules q_proj v_proj``, ``--no_load_in_4bit``."""
    if key == "load_in_4bit":
        return f"--{key}" if value else f"--no_{key}"
    return f"--{key} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def check_resumable(folder: Path, saved: RunState, now: RunState, step: int) -> dict[str, tuple]:
    """Refuse (ResumeMismatch) a resume that would not continue ``saved``'s run exactly; return what changed.

    Exact means: the same world size (ZeRO's optimizer state is partitioned per rank, and openpack does
    not convert it), the same --ring_attn_size (it decides the data-parallel plan), the same ZeRO stage,
    precision and LoRA adapters (``LORA``), and the same samples in each
    of the first ``step`` steps of the new plan (so ``--max_steps``/``--max_epochs`` may grow a run, while a new
    ``--train_batch_size``, ``--seed``, ``--max_len`` or dataset, which would skip or repeat samples,
    is refused). ``now.config`` may be {} (no config known): then only the plan and world size count.
    """
    changes = changed_settings(saved.config, now.config) if now.config and saved.config else {}
    fix = "Put them back to resume, or start a new run: another --save_path, or --overwrite"
    listed = f"Settings that differ (saved -> now): {_listed(changes)}" if changes else "No setting differs"
    if saved.world_size != now.world_size:
        raise ResumeMismatch(
            f"cannot resume {folder}: it was written by {saved.world_size} rank(s) and this run has {now.world_size}. "
            "ZeRO partitions the optimizer state per rank and openpack does not convert checkpoints between world "
            f"sizes; resume on {saved.world_size} rank(s) (--num_nodes x --num_gpus_per_node), or start a new run "
            f"(another --save_path, or --overwrite). {listed}")
    rings = [config.get("ring_attn_size") or 1 for config in (saved.config, now.config)]
    if now.config and saved.config and rings[0] != rings[1]:
        raise ResumeMismatch(
            f"cannot resume {folder}: it was written with --ring_attn_size {rings[0]} and this run has "
            f"--ring_attn_size {rings[1]}; ranks sharing rows change the data-parallel plan, so the steps would "
            f"train other samples. Resume with --ring_attn_size {rings[0]}, or start a new run (another "
            "--save_path, or --overwrite)")
    lora = lora_changes(saved.config, now.config) if now.config and saved.config else {}
    if lora:
        listed_lora = ", ".join(f"{_as_flag(k, a)} -> {_as_flag(k, b).removeprefix(f'--{k} ')}"
                                for k, (a, b) in lora.items())
        raise ResumeMismatch(f"cannot resume {folder}: this run changes the LoRA adapters ({listed_lora}); the "
                             "checkpoint's adapter weights and optimizer state fit only the adapters it was saved "
                             f"with. Resume with {' '.join(_as_flag(k, a) for k, (a, _) in lora.items())}, or "
                             "start a new run: another --save_path, or --overwrite")
    layout = {k: v for k, v in changes.items() if k in LAYOUT}
    if layout:
        raise ResumeMismatch(f"cannot resume {folder}: DeepSpeed cannot load its optimizer state across a change "
                             f"of {_listed(layout)}. {fix}")
    if len(saved.data_order) != step:
        raise CheckpointDamaged(f"cannot resume {folder}: its {DATA_ORDER} lists {len(saved.data_order)} steps, "
                                f"the checkpoint is at step {step}")
    if len(now.data_order) < step:
        raise ResumeMismatch(f"cannot resume {folder} at step {step}: this run plans only {len(now.data_order)} "
                             f"steps. {listed}. {fix}")
    first = next((i for i, (a, b) in enumerate(zip(saved.data_order, now.data_order)) if a != b), None)
    if first is not None:
        cause = listed if changes else "No setting differs: has the data changed?"
        raise ResumeMismatch(f"cannot resume {folder} exactly: from step {first + 1} on, this run's plan trains other "
                             f"samples than the run that wrote it (it would skip or repeat samples). {cause}. {fix}")
    return changes


def check_optimizer_layout(engine, folder: Path) -> None:
    """Refuse (ResumeMismatch) a checkpoint whose optimizer state is laid out for another ZeRO stage than ``engine``'s.

    ZeRO 1-3 save it in ``*optim_states.pt`` files, stage 0 inside the model-states file; DeepSpeed loads neither
    from the other (a traceback deep in torch). The flags can agree while the layouts differ: one CPU rank runs
    ZeRO-1/2 as stage 0 (``engine.engine_stage``), so a one-rank checkpoint written before that, or one resumed
    with another offload setting, has the other layout.
    """
    saved = "ZeRO's partitions" if any(folder.glob("*optim_states.pt")) else "stage 0's"
    now = "ZeRO's partitions" if engine.zero_optimization_stage() > 0 else "stage 0's"
    if saved != now:
        raise ResumeMismatch(
            f"cannot resume {folder}: its optimizer state is in {saved} layout, and this run's DeepSpeed engine "
            f"(ZeRO stage {engine.zero_optimization_stage()}) loads only {now}. One CPU rank runs --zero_stage 1/2 "
            "as stage 0 without --adam_offload or --param_offload, and with them ZeRO, since 2026-11-27. Resume it "
            f"with the flags, ranks and openpack version that wrote it, or start a new run from its weights: "
            f"--pretrain {folder / 'hf_model'}")


def load_checkpoint(engine, folder: Path, companions: dict | None = None) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG from a verified checkpoint (and each companion engine
    from its subfolder); returns the client state."""
    folder = Path(folder)
    check_optimizer_layout(engine, folder)
    for name, companion in (companions or {}).items():
        if (folder / name).is_dir():
            check_optimizer_layout(companion, folder / name)
    path, client_state = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if path is None:
        raise CheckpointDamaged(f"DeepSpeed could not load {folder} (see its log above)")
    for name, companion in (companions or {}).items():
        if not (folder / name).is_dir():
            raise CheckpointDamaged(f"{folder} has no {name}/ (saved by a run without a {name}); resume with the "
                                    f"flags of the run that wrote it, or start anew")
        if companion.load_checkpoint(str(folder), tag=name)[0] is None:
            raise CheckpointDamaged(f"DeepSpeed could not load the {name} of {folder} (see its log above)")
    set_rng_state(torch.load(folder / f"rng_rank{torch.distributed.get_rank()}.pt", weights_only=False))
    return client_state
