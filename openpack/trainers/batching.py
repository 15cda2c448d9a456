"""From the sample ids of a rank's micro-batches to collated batches, in one of three layouts.

=================================  =====================================  ================
flags                              a micro-batch is                       collated as
=================================  =====================================  ================
--packing_samples --use_dynamic_batch  one row of <= --max_tokens_per_gpu  PackedBatch
--packing_samples                  --micro_train_batch_size samples, 1 row  PackedBatch
(neither)                          --micro_train_batch_size padded rows     PaddedBatch
=================================  =====================================  ================

Which samples form each micro-batch is decided once for the whole run
(``core/schedule.plan_run``, from lengths only); here they are only
collated. The trainer sees micro-batches whose forward (``PackedCausalLM``)
returns per-token log-probs either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from openpack.core.batch import PackedBatch, Segment, collate_packed, collate_padded
from openpack.core.context_parallel import held_labels, shard_batch, split_row
from openpack.core.schedule import Batching, RankStep, plan_scoring
from openpack.distributed.process import join_context_group
from openpack.models.errors import UnsupportedModelError
from openpack.models.packed import router_loss
from openpack.trainers.metrics import DeviceSums, StepMetrics

logger = logging.getLogger("openpack")


@dataclass(frozen=True)
class ContextPlace:
    """This rank's place in its context group (``--ring_attn_size``): it trains its ``rank``'s part of each row
    that the group's ``size`` ranks share (``core.context_parallel``)."""

    size: int = 1
    rank: int = 0

    def part(self, batch: PackedBatch) -> PackedBatch:
        return self.split(batch)[0]

    def split(self, batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor | None]:
        """This rank's part of ``batch`` and which of the row's labelled tokens it holds (``held_labels``: [N_r]
        indices into them in row order); ``batch`` itself and None where rows are not split."""
        if self.size == 1:
            return batch, None
        part = shard_batch(batch, split_row(batch.cu_seqlens, self.size)[self.rank])
        return part, held_labels(batch.loss_mask, part.context_shard)

    def counted(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A micro-batch's per-pair statistics as this rank adds them to the step's sums over the world: the
        group's ranks compute the same pairs' values, so rank 0 of the group counts them and the others add 0."""
        return stats if self.rank == 0 else {name: torch.zeros_like(value) for name, value in stats.items()}


def context_parallel_size(train_cfg) -> int:
    """--ring_attn_size: 1 where it is unset (None), and in the commands without the flag (all but train_sft,
    train_dpo and train_rm)."""
    return getattr(train_cfg, "ring_attn_size", None) or 1


def join_context(train_cfg, model=None) -> ContextPlace:
    """This rank's place in its context group of --ring_attn_size ranks (every rank calls it at the same point:
    forming the groups is collective). ``model``: one that trains its MoE router loss (a causal LM; a reward
    model does not), refused under a ring."""
    ring = context_parallel_size(train_cfg)
    # the router loss is a function of each row's whole token set
    if ring > 1 and model is not None and router_loss(model.config) is not None:
        raise UnsupportedModelError(f"--ring_attn_size {ring}: an MoE model's router load-balancing loss is not "
                                    "split over a context group yet; train it without --ring_attn_size")
    return ContextPlace(ring, join_context_group(ring))


@dataclass
class MicroBatcher:
    """segments(i) gives sample i's segments (one for SFT, two for a pair: chosen, rejected)."""

    segments: Callable[[int], list[Segment]]
    packing_samples: bool
    pad_token_id: int = 0
    context: ContextPlace = ContextPlace()

    def collate(self, micro_batches: list[list[int]]) -> list:
        """Each micro-batch as this rank trains it: its part of the packed row (``context``), or the padded rows."""
        return [self.context.part(batch) for batch in self.rows(micro_batches)]

    def rows(self, micro_batches: list[list[int]]) -> list:
        """Each micro-batch whole: one packed row (before a context group splits it), or padded rows."""
        batches = []
        for sample_ids in micro_batches:
            segments = [seg for i in sample_ids for seg in self.segments(i)]
            if self.packing_samples:
                batches.append(collate_packed(segments))
            else:
                batches.append(collate_padded(segments, self.pad_token_id))
        return batches


def scoring_batches(pairs: list, max_tokens: int, dist) -> list:
    """This rank's share of one packed pass over ``pairs`` (each with ``lengths()`` and ``segments(i)``), in rows of
    ``max_tokens`` (or one pair's length), for evaluation and reference or reward scoring."""
    share = plan_scoring([p.lengths() for p in pairs], dist.world_size, max_tokens)[dist.rank]
    return MicroBatcher(lambda i: pairs[i].segments(i), packing_samples=True).collate(share)


def batching(train_cfg) -> Batching:
    """Token-capped packs under --packing_samples --use_dynamic_batch, else --micro_train_batch_size samples.
    A row shared by a context group of N ranks holds up to N x --max_tokens_per_gpu tokens."""
    if train_cfg.packing_samples and train_cfg.use_dynamic_batch:
        return Batching(max_tokens=train_cfg.max_tokens_per_gpu * context_parallel_size(train_cfg))
    return Batching(micro_batch_size=train_cfg.micro_train_batch_size)


def training_memory(model, model_cfg, world_size: int, gradient_checkpointing: bool, frozen_params: int = 0):
    """``models.memory.step_memory`` of ``model`` as it will train (after ``apply_lora``): only the parameters that
    require a gradient (LoRA's adapters and a reward or value head, or every weight without LoRA) have gradients and
    AdamW states; the others (a LoRA base), and the ``frozen_params`` of a colocated reference model, weights only."""
    from openpack.models.memory import step_memory

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + frozen_params
    return step_memory(model.config, trainable, model_cfg.bf16, gradient_checkpointing, model_cfg.zero_stage,
                       world_size, model_cfg.adam_offload, frozen)


def default_row_cap(model, model_cfg, dist, longest: int) -> tuple[int, str]:
    """``models.memory.default_row_cap`` for ``model`` as it trains on this rank's device: (tokens, why)."""
    import os

    from openpack.models import memory

    need = training_memory(model, model_cfg, dist.world_size, model_cfg.gradient_checkpointing)
    one_rank = training_memory(model, model_cfg, 1, model_cfg.gradient_checkpointing)
    budget = memory.device_memory(dist.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return memory.default_row_cap(need, one_rank.states, budget, dist.device.type == "cpu", longest)


def warn_if_memory_short(model, model_cfg, train_cfg, max_len: int, dist, segments_per_sample: int = 1,
                         frozen_params: int = 0) -> str | None:
    """Before the first step: the warning of ``models.memory`` when a micro-batch's tokens cannot fit this device.

    A micro-batch is ``--max_tokens_per_gpu`` tokens under dynamic batching, else ``--micro_train_batch_size``
    samples of up to ``--max_len`` tokens per segment. ``model`` as it trains (LoRA applied: ``training_memory``);
    ``frozen_params``: a colocated reference model's.
    """
    import os

    from openpack.models.memory import budget_warning, device_memory

    if train_cfg.packing_samples and train_cfg.use_dynamic_batch:
        tokens, flag = train_cfg.max_tokens_per_gpu, "--max_tokens_per_gpu"
    else:
        tokens, flag = train_cfg.micro_train_batch_size * max_len * segments_per_sample, "--micro_train_batch_size"

    def need(checkpointing: bool):
        return training_memory(model, model_cfg, dist.world_size, checkpointing, frozen_params)

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.device.type == "cpu":
        where = "this machine's memory" + (f", shared by {ranks_here} ranks," if ranks_here > 1 else "")
    else:
        where = f"{dist.device} ({torch.cuda.get_device_name(dist.device)})"
    warning = budget_warning(need(model_cfg.gradient_checkpointing), tokens, device_memory(dist.device, ranks_here),
                             flag, where, None if model_cfg.gradient_checkpointing else need(True))
    if warning and dist.is_main:
        logger.warning(warning)
    return warning


def step_metrics(step: RankStep, engine, grad_norm, sums: DeviceSums, finish, start: float,
                 rates: dict[str, float] | None = None) -> StepMetrics:
    """A step's metrics, read when logged: ``finish(totals)`` of the ``sums`` over every rank, and what every
    trainer reports besides its loss: lr, grad norm, the non-finite steps skipped so far, tokens, speed (``rates`` adds e.g. pairs/s), packing."""
    values = {"lr": engine.get_lr()[0], "grad_norm": grad_norm, "skipped_steps": engine.step_guard.skipped,
              "tokens": step.real_tokens, "micro_batches": len(step.micro_batches)}
    if step.packing_efficiency is not None:
        values["packing_efficiency"] = step.packing_efficiency
    return StepMetrics(sums, finish, values, {**(rates or {}), "tokens_per_s": step.real_tokens}, start)
