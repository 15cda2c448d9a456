"""The reference model of preference losses, as something that scores segments.

Two scorers, one interface (``segment_sums(batch) -> [S]`` summed label
log-probs per segment), so the DPO step never branches on where reference
log-probs come from. A scorer returns whole segments' sums, also for one rank's
part of a row split over a context group (``--ring_attn_size``: the model
scorers sum the group's parts, the cache holds whole sums):

* ``ModelReference``: a frozen copy of the model in the same process as the
  policy (colocated), scoring exactly the packs the policy trains on. Memory:
  one more set of weights (bf16: 2 bytes x parameters), partitioned across
  ranks under ZeRO-3, or on the CPU with ``--ref_offload``.
* ``AdapterReference`` (LoRA): the policy itself with its adapters switched
  off, which is exactly the base model; no second copy of the weights.
* ``CachedReference``: log-probs computed once by a ``ModelReference`` over
  the whole dataset (``--ref_logps_cache FILE``), stored with a key of the
  reference model's files and the tokenized pairs, reused by later epochs and
  runs; the reference model is freed after the precompute. Memory: 8 bytes
  per pair.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path

import torch

from openpack.core.batch import CHOSEN, REJECTED
from openpack.core.logprobs import segment_logprobs
from openpack.data.loading import DataError
from openpack.distributed.process import all_reduce_sum
from openpack.models.context_parallel import whole_segment_values
from openpack.models.lora import adapters_disabled


class ModelReference:
    """A frozen model (a DeepSpeed engine without optimizer) scoring packed or padded batches."""

    def __init__(self, engine, device):
        self.engine, self.device = engine, device
        engine.eval()

    @torch.no_grad()
    def segment_sums(self, batch) -> torch.Tensor:
        """Each segment's whole sum, also for one rank's part of a split row (``--ring_attn_size``)."""
        batch = batch.to(self.device)
        return whole_segment_values(batch, segment_logprobs(batch, self(batch)).sum)

    @torch.no_grad()
    def __call__(self, batch) -> torch.Tensor:
        """Per-token log-probs laid out like ``batch.labels`` flattened (online RL's KL needs every token)."""
        return self.engine(batch.to(self.device))


class AdapterReference(ModelReference):
    """LoRA's reference: the policy's own engine with its adapters disabled (peft's ``disable_adapter``), so the
    frozen base model, loaded once, scores as the reference. The policy's engine stays in training mode."""

    def __init__(self, engine, model, device):
        self.engine, self.model, self.device = engine, model, device

    @torch.no_grad()
    def __call__(self, batch) -> torch.Tensor:
        with adapters_disabled(self.model):
            return self.engine(batch.to(self.device))


class CachedReference:
    """Per-sample reference log-probs looked up through the segment table."""

    def __init__(self, chosen: torch.Tensor, rejected: torch.Tensor):
        self.table = torch.stack([chosen, rejected])  # [2, N]: row 0 chosen, row 1 rejected

    def segment_sums(self, batch) -> torch.Tensor:
        row = (batch.role == REJECTED).long()
        return self.table[row, batch.sample_index].to(batch.sample_index.device)


def reference_engine(model, zero_stage: int, offload: bool, bf16: bool):
    """deepspeed.initialize for inference: ZeRO-3 partitions (and offloads) it like the policy, else stage 0."""
    import deepspeed

    from openpack.distributed.engine import gather_head_with_forward
    from openpack.models.packed import PackedCausalLM

    stage = 3 if zero_stage == 3 else 0
    zero = {"stage": stage}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    for param in model.parameters():
        param.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "bf16": {"enabled": bf16},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=PackedCausalLM(model), config=config)
    if stage == 3:
        gather_head_with_forward(engine.module)
    return engine


def cache_key(reference_name: str, pairs_fingerprint: str) -> str:
    """Identity of the reference model (its config and weight files) and of the tokenized data."""
    model = {"name": reference_name}
    folder = Path(reference_name).expanduser()
    if folder.is_dir():
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
        model["files"] = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]
    return hashlib.sha256(json.dumps({"model": model, "data": pairs_fingerprint}).encode()).hexdigest()


def load_or_build_cache(path, key: str, num_samples: int, score_all, dist) -> CachedReference:
    """Load ``path`` if its key matches; otherwise compute with ``score_all`` and save it atomically."""
    path = Path(path)
    if path.exists():
        stored = torch.load(path, weights_only=True)
        if stored["key"] != key or stored["chosen"].numel() != num_samples:
            raise DataError(
                f"--ref_logps_cache {path}: computed for another reference model or dataset "
                f"({stored['chosen'].numel()} pairs cached, {num_samples} now); delete the file or point "
                "--ref_logps_cache at a new path"
            )
        return CachedReference(stored["chosen"], stored["rejected"])
    chosen, rejected = score_all()
    if dist.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"key": key, "chosen": chosen, "rejected": rejected}, tmp)
        os.replace(tmp, path)
    return CachedReference(chosen, rejected)


def score_dataset(score, batches: list, num_samples: int, dist) -> tuple[torch.Tensor, torch.Tensor]:
    """One value per segment of every pair, as (chosen [N], rejected [N]): each rank scores its share of the packs
    with ``score(batch) -> [S]`` (a reference's ``segment_sums``, a reward model), then the results are summed."""
    chosen = torch.zeros(num_samples, dtype=torch.float64)
    rejected = torch.zeros(num_samples, dtype=torch.float64)
    for batch in batches:
        sums = score(batch).double().cpu()
        roles, ids = batch.role.cpu(), batch.sample_index.cpu()
        chosen[ids[roles == CHOSEN]] = sums[roles == CHOSEN]
        rejected[ids[roles == REJECTED]] = sums[roles == REJECTED]
    merged = torch.tensor(all_reduce_sum(torch.cat([chosen, rejected]).tolist(), dist.device))
    return merged[:num_samples].float(), merged[num_samples:].float()


def free(reference: ModelReference) -> None:
    """Drop the reference model once its log-probs are cached."""
    del reference.engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
