"""Join (or form) the process group every worker trains in.

Ranks come from the environment that torchrun, the deepspeed launcher or a
Ray actor sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); with
none set, this is a one-process group on a free local port. NCCL on CUDA,
gloo on CPU, where DeepSpeed also needs ``DS_ACCELERATOR=cpu`` set before it
is first imported.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (idempotent) and return this process's place."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ or _inherited_one_process_group():
        stale = "RANK" in os.environ
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if stale or "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        os.environ[_ONE_PROCESS] = f"{os.getpid()}:{os.environ['MASTER_PORT']}"
    import deepspeed

    # DeepSpeed's ZeRO calls these on every step; torch 2.13's deprecation notice would flood the console.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        _forget_deepspeed_groups()
        deepspeed.init_distributed(dist_backend=backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    _share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size())))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


def _forget_deepspeed_groups() -> None:
    """Drop DeepSpeed's clone of an earlier world group before a new world is formed in this process.

    DeepSpeed clones the world group once per process (``deepspeed.utils.groups._WORLD_GROUP``) and reuses the
    clone in every later ``deepspeed.initialize``. When that world is destroyed (an in-process vLLM engine's
    shutdown destroys the default group, whoever formed it), the next run in the same process got
    "Group ... is not registered" from its first broadcast.
    """
    from deepspeed.utils import groups

    if getattr(groups, "_WORLD_GROUP", None) is not None:
        groups._WORLD_GROUP = None


_ONE_PROCESS = "OPENPACK_ONE_PROCESS_GROUP"  # "pid:port" of the one-process group this process formed


def _inherited_one_process_group() -> bool:
    """True when RANK & co. are a copy of a parent's one-process group (the parent still holds its port).

    DeepSpeed reads these variables after initialisation, so they stay in the
    environment, and a child process (a subprocess of a test or notebook that
    trained in-process) inherits them. torchrun and Ray set a new MASTER_PORT,
    so their ranks never match.
    """
    pid, _, port = os.environ.get(_ONE_PROCESS, "").partition(":")
    return bool(pid) and pid != str(os.getpid()) and port == os.environ.get("MASTER_PORT")


def _share_cpu_threads(local_world_size: int) -> None:
    """Give each rank on a node its share of the cores, unless OMP_NUM_THREADS says otherwise.

    Two CPU ranks with a full thread pool each on 2 cores made every tiny op
    ~100x slower here (OpenMP threads spinning against each other).
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum floats over ranks (fp64, so step losses add up exactly enough to compare runs)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def join_context_group(size: int) -> int:
    """Form the context groups of ``size`` consecutive ranks (``--ring_attn_size``) and make this rank's the one
    packed attention gathers keys over (``models.context_parallel``); returns this rank's place in it.

    Every rank creates every group, as ``torch.distributed.new_group`` requires. A group of its own even when it
    spans the world: its collectives then never queue behind DeepSpeed's on one communicator.
    """
    from openpack.models.context_parallel import set_context_group

    if size == 1:
        set_context_group(None)
        return 0
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    groups = [torch.distributed.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    set_context_group(groups[rank // size])
    atexit.register(_leave_context_group, groups[rank // size])
    return rank % size


def _leave_context_group(group) -> None:
    """Destroy this rank's context group while the interpreter is whole. Left to finalisation, a gloo worker
    thread still releasing a collective's tensors took the GIL after Python began to shut down and aborted the
    process ("terminate called without an active exception", exit 134, in 1 of 10 runs on 2 CPU ranks) after the
    run had finished."""
    from openpack.models.context_parallel import set_context_group

    set_context_group(None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group(group)


def exit_now(code: int = 0):
    """End a process that ran gloo collectives, skipping the interpreter's finalisation (stdio flushed first).

    A gloo worker thread drops a finished collective's tensors after the caller already has its result, and for
    tensors Python made that needs the GIL. In a process already finalising, Python ends such a thread inside a
    noexcept destructor and the process aborts ("terminate called without an active exception", exit 134) after
    its work was done: 1 run in 50-100 of ``tests/integration/context_parallel_script.py`` on 2 CPU ranks, where a
    rank exits right after its last all-gather. ``destroy_process_group`` does not join the workers while anything
    (a variable, an autograd node's saved group) still refers to the group.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_gather_objects(value) -> list:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` without a process group."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [value]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value, src: int = 0):
    """Rank ``src``'s ``value`` on every rank (the others pass anything, e.g. None)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]
