"""Checkpoints that survive a crash at any moment, and resume exactly.

Layout under ``ckpt_path``::

    global_step4/            one DeepSpeed checkpoint (model, optimizer, scheduler; the trainer's
                             position - epoch, step - in DeepSpeed's client state)
        rng_rank{r}.pt       each rank's Python, NumPy and torch RNG states
        hf_model/            the same weights as a Hugging Face folder (from_pretrained loads it)
    latest                   the tag of the newest complete checkpoint

Every checkpoint is written under a temporary name and renamed into place
once all ranks have finished, and ``latest`` is replaced atomically, so a
crash mid-write leaves the previous checkpoint as the latest. Only the newest
``max_ckpt_num`` are kept.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from openpack.distributed.process import barrier

LATEST = "latest"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


def save_hf_model(engine, tokenizer, out_dir: Path, is_main: bool) -> None:
    """Write engine.module.model as a Hugging Face folder, atomically (ZeRO-3 parameters gathered)."""
    import deepspeed

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    model = engine.module.model
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    if is_main:
        _replace_dir(tmp, out_dir)
    barrier()


def _replace_dir(tmp: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(engine, tokenizer, ckpt_path, step: int, client_state: dict, max_ckpt_num: int, is_main: bool) -> Path:
    """DeepSpeed checkpoint + HF folder for ``step``; returns its directory."""
    ckpt_path = Path(ckpt_path)
    tag = f"global_step{step}"
    staging = f".{tag}.tmp"
    if is_main:
        ckpt_path.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ckpt_path / staging, ignore_errors=True)
    barrier()
    engine.save_checkpoint(str(ckpt_path), tag=staging, client_state=client_state, save_latest=False)
    torch.save(rng_state(), ckpt_path / staging / f"rng_rank{torch.distributed.get_rank()}.pt")
    save_hf_model(engine, tokenizer, ckpt_path / staging / "hf_model", is_main)
    if is_main:
        _replace_dir(ckpt_path / staging, ckpt_path / tag)
        write_text_atomic(ckpt_path / LATEST, tag)
        _prune(ckpt_path, max_ckpt_num)
    barrier()
    return ckpt_path / tag


def _prune(ckpt_path: Path, keep: int) -> None:
    tags = sorted((p for p in ckpt_path.glob("global_step*") if p.is_dir()), key=lambda p: int(p.name[11:]))
    for old in tags[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest_tag(ckpt_path) -> str | None:
    latest = Path(ckpt_path) / LATEST
    return latest.read_text().strip() if latest.exists() else None


def load_checkpoint(engine, ckpt_path) -> dict | None:
    """Restore model, optimizer, scheduler and RNG from the latest checkpoint; its client state, or None."""
    tag = latest_tag(ckpt_path)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(str(ckpt_path), tag=tag)
    if path is None:
        raise FileNotFoundError(f"--load_checkpoint: {Path(ckpt_path) / tag} is listed as latest but could not be loaded")
    rng_file = Path(ckpt_path) / tag / f"rng_rank{torch.distributed.get_rank()}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved: those start from their seed
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state
