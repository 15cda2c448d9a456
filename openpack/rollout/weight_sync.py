"""Policy weights to the rollout engines after each update: one interface, two transports.

``policy_weights`` streams the trainer's parameters under their Hugging Face names; under ZeRO-3 it gathers
one parameter at a time, so the full model exists at most once more than a single parameter. Every rank
iterates (the gathers are collective); only rank 0's tensors are sent.

``buckets.layer_buckets`` groups that stream into buckets of whole decoder layers (~``bucket_bytes``): vLLM fuses
q/k/v and gate/up into one layer and finalises a layer after each reload call, so a call must never carry
part of a layer (see ``worker_extension``).

Transports:

- ``InHostSync`` (``--vllm_sync_backend inhost``): buckets go through ``EngineGroup.update_weights``, i.e. as
  call arguments (Ray's object store between machines), into each worker's ``reload_weights``. Runs on CPU
  and in CI; the cost is a copy through host memory, fine for small models and CPU runs.
- ``NcclSync`` (``--vllm_sync_backend nccl``): rank 0 and every engine worker form one NCCL group with vLLM's
  public ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (the OpenRLHF design) and rank 0 broadcasts each
  bucket GPU to GPU. vLLM 0.32 also has a newer ``vllm.distributed.weight_transfer`` API; it is not used
  because its trainer side expects whole-model sources and it has changed shape in recent releases, while the
  two classes used here have been stable since 0.6. **NcclSync has not run on GPUs yet**: only its
  bookkeeping is tested, on CPU.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Protocol

import torch

from openpack.distributed.process import free_port
from openpack.rollout.buckets import layer_buckets
from openpack.rollout.engine_group import EngineGroup
from openpack.rollout.interface import DEFAULT_BUCKET_BYTES

WRAPPER_PREFIX = "model."  # PackedCausalLM keeps the HF model as .model
SYNC_BACKENDS = ("inhost", "nccl")


def hf_name(wrapped_name: str) -> str:
    """'model.model.layers.0.mlp.up_proj.weight' -> 'model.layers.0.mlp.up_proj.weight' (one prefix stripped)."""
    if not wrapped_name.startswith(WRAPPER_PREFIX):
        raise ValueError(f"parameter {wrapped_name!r} is not under PackedCausalLM's {WRAPPER_PREFIX!r}")
    return wrapped_name[len(WRAPPER_PREFIX):]


def policy_weights(module: torch.nn.Module, zero_stage: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, detached full tensor) for each parameter of a PackedCausalLM (the DeepSpeed engine's module).

    A tied weight is sent under every name it has: a model with tied embeddings sends ``lm_head.weight`` too.
    ``named_parameters()`` lists a tied weight once, but vLLM's reload unties the head (on CPU the head keeps its
    own repacked copy, refreshed only when ``lm_head.weight`` itself is loaded): measured on a tiny tied Llama,
    the engine's log-probs stayed 1.4 from the trainer's after a push without it, 7e-7 with it (issue 23).

    Under ZeRO-3 each parameter is gathered alone and copied before the next is gathered. Every rank must
    exhaust this iterator in the same order, because the gathers are collective. A LoRA policy sends its merged
    weights under the base model's names (``models.lora.merged_weights``): vLLM holds the plain model.
    """
    from openpack.models.lora import is_lora, merged_weights

    if is_lora(module.model):
        yield from merged_weights(module.model, zero_stage, tied_aliases=True)
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        if zero_stage == 3 and hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                tensor = param.data.detach().clone()
        else:
            tensor = param.data.detach()
        yield hf_name(name), tensor


def policy_weight_names(module: torch.nn.Module) -> list[str]:
    """The HF names ``policy_weights`` sends, in order, found without gathering or copying any tensor."""
    from openpack.models.lora import is_lora, merged_weight_names

    if is_lora(module.model):
        return merged_weight_names(module.model)
    return [hf_name(name) for name, _ in module.named_parameters(remove_duplicate=False)]


class WeightNamesError(ValueError):
    """The weights the trainer sends and the weights a vLLM engine holds do not match (found before any push)."""


def check_weight_names(engines: EngineGroup, names: list[str]) -> None:
    """Refuse, before the first push, a policy whose sent weights would leave an engine weight stale or unknown.

    Each engine maps ``names`` to its own parameter names (``worker_extension.openpack_check_weight_names``) and
    reports what it holds that nothing sent reaches, and what is sent that it has no place for.
    """
    for index, (missing, unknown) in enumerate(engines.check_weight_names(list(names))):
        if missing or unknown:
            raise WeightNamesError(
                f"weight sync: vLLM engine {index} of {engines.num_engines} and the policy disagree on weight names"
                + (f"; the engine holds weights the policy never sends, which would stay stale: {_listed(missing)}"
                   if missing else "")
                + (f"; the policy sends weights the engine has no place for: {_listed(unknown)}" if unknown else "")
                + ". openpack sends the policy's parameters under their Hugging Face names (tied weights under "
                "each name); this model's vLLM implementation expects others. Use --rollout_backend hf "
                "(generation by the policy itself) for this model."
            )


def _listed(names: list[str], shown: int = 5) -> str:
    """'a, b, c, d, e and 2 more'."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


class WeightSync(Protocol):
    """Pushes the policy's weights to every engine; call on every rank with that rank's ``policy_weights``."""

    def push(self, weights: Iterator[tuple[str, torch.Tensor]], is_main: bool) -> float:
        """Send ``weights`` (rank 0) or only iterate them (other ranks); returns the seconds it took."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers of the last push beyond its time."""
        ...


class InHostSync:
    """Buckets through ``EngineGroup.update_weights`` (host memory, Ray's object store across machines)."""

    def __init__(self, engines: EngineGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.object_store_bytes = None  # what the last push put into Ray's object store (remote engines)

    def push(self, weights: Iterator[tuple[str, torch.Tensor]], is_main: bool) -> float:
        start = time.perf_counter()
        if is_main:
            before = self.engines.object_store_bytes
            self.engines.update_weights(((n, t.cpu()) for n, t in weights), self.bucket_bytes)
            if self.engines.remote:
                self.object_store_bytes = self.engines.object_store_bytes - before
        else:
            for _ in weights:  # the ZeRO-3 gathers are collective: take part, send nothing
                pass
        return time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """What the last push put into Ray's object store (engines that are Ray actors; nothing in-process)."""
        pushed = self.object_store_bytes
        return {} if pushed is None else {"weight_sync/object_store_mb": pushed / 2**20}


def nccl_rank_offsets(workers_per_engine: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the sync group, and the group's size: rank 0 is the trainer.

    nccl_rank_offsets([2, 2]) == ([1, 3], 5): engine 0's workers are ranks 1-2, engine 1's are 3-4.
    """
    offsets, next_rank = [], 1
    for workers in workers_per_engine:
        offsets.append(next_rank)
        next_rank += workers
    return offsets, next_rank


def bucket_metadata(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    """What the receivers allocate, in broadcast order: (name, dtype name, shape) per tensor."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]


class NcclSync:
    """NCCL broadcast from rank 0 into every engine worker (multi-node GPUs). Not yet run on GPUs.

    Rank 0 forms the group on its first ``push`` (or ``connect()``); ``host``/``port`` are rank 0's address and
    a port the engines can reach, by default this host's address and a free port.
    """

    def __init__(self, engines: EngineGroup, host: str | None = None, port: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.engines = engines
        self.host, self.port = host, port
        self.bucket_bytes = bucket_bytes
        self._comm = None

    def connect(self) -> None:
        """Form the group: the engines join in the background while rank 0 joins here."""
        require_cuda_for_nccl()
        if not self.engines.remote:
            raise ValueError("--vllm_sync_backend nccl needs the engines as Ray actors; use inhost for in-process engines")
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        host = self.host or socket.gethostbyname(socket.gethostname())
        port = self.port or free_port()
        offsets, world_size = nccl_rank_offsets(self.engines.broadcast_call("num_workers"))
        refs = [
            engine.init_weight_group.remote(host, port, offset, world_size)
            for engine, offset in zip(self.engines.engines, offsets)
        ]
        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
        self._comm = PyNcclCommunicator(group, device=torch.cuda.current_device())
        self.engines.wait(refs)

    def push(self, weights: Iterator[tuple[str, torch.Tensor]], is_main: bool) -> float:
        start = time.perf_counter()
        if not is_main:
            for _ in weights:
                pass
            return time.perf_counter() - start
        if self._comm is None:
            self.connect()
        device = torch.device("cuda", torch.cuda.current_device())
        for bucket in layer_buckets(weights, self.bucket_bytes):
            refs = self.engines.submit("receive_weights", bucket_metadata(bucket))
            for _, tensor in bucket:
                self._comm.broadcast(tensor.to(device), src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            self.engines.wait(refs)
        return time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """Nothing beyond the push's time: NCCL moves the weights device to device."""
        return {}


def require_cuda_for_nccl() -> None:
    """NcclSync's refusal where there is no CUDA device, naming the flag that works."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "--vllm_sync_backend nccl broadcasts weights over NCCL and needs CUDA GPUs on the trainer and the "
            "engines; this machine has none. Use --vllm_sync_backend inhost (works on CPU and across nodes)."
        )


def make_weight_sync(backend: str, engines: EngineGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     host: str | None = None, port: int | None = None):
    """The WeightSync for ``--vllm_sync_backend``: 'inhost' or 'nccl' (``host``/``port``: see NcclSync)."""
    if backend == "inhost":
        return InHostSync(engines, bucket_bytes)
    if backend == "nccl":
        require_cuda_for_nccl()
        return NcclSync(engines, host, port, bucket_bytes)
    raise ValueError(f"--vllm_sync_backend must be one of {SYNC_BACKENDS}, got {backend!r}")
