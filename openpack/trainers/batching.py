"""From a step's sample ids to this rank's micro-batches, in one of three layouts.

=================================  =====================================  ================
flags                              a micro-batch is                       collated as
=================================  =====================================  ================
--packing_samples --use_dynamic_batch  one row of <= --max_tokens_per_gpu  PackedBatch
--packing_samples                  --micro_train_batch_size samples, 1 row  PackedBatch
(neither)                          --micro_train_batch_size padded rows     PaddedBatch
=================================  =====================================  ================

The layout is chosen once, here; the trainer only sees micro-batches whose
forward (``PackedCausalLM``) returns per-token log-probs either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from openpack.core.batch import Segment, collate_packed, collate_padded
from openpack.core.schedule import StepPlan, plan_step


@dataclass
class MicroBatcher:
    """segments(i) gives sample i's segments (one for SFT, two for a pair); lengths are their token counts."""

    segments: Callable[[int], list[Segment]]
    group_lengths: Sequence[Sequence[int]]
    world_size: int
    packing_samples: bool
    max_tokens_per_gpu: int | None  # set: dynamic batching
    micro_batch_size: int
    pad_token_id: int = 0

    def plan(self, sample_ids: Sequence[int]) -> StepPlan:
        if self.max_tokens_per_gpu is not None:
            return plan_step(sample_ids, self.group_lengths, self.world_size, max_tokens=self.max_tokens_per_gpu)
        return plan_step(sample_ids, self.group_lengths, self.world_size, micro_batch_size=self.micro_batch_size)

    def label_tokens(self, sample_ids: Sequence[int], role: int | None = None) -> int:
        """Label tokens of these samples (targets after each segment's first token), of one role if given.

        Every rank computes this for the whole step from the same plan, so the
        step's loss normaliser needs no communication.
        """
        return sum(
            sum(seg.targets[1:]) for i in sample_ids for seg in self.segments(i) if role is None or seg.role == role
        )

    def micro_batches(self, plan: StepPlan, rank: int) -> list:
        batches = []
        for sample_ids in plan.rank_micro_batches[rank]:
            segments = [seg for i in sample_ids for seg in self.segments(i)]
            if self.packing_samples:
                batches.append(collate_packed(segments))
            else:
                batches.append(collate_padded(segments, self.pad_token_id))
        return batches


def step_metrics(plan: StepPlan, batcher: MicroBatcher, engine, grad_norm: float, micro_batches: int,
                 elapsed: float) -> dict:
    """What every trainer reports for a step besides its loss: lr, grad norm, tokens, speed, packing."""
    real_tokens = plan.real_tokens(batcher.group_lengths)
    metrics = {
        "lr": engine.get_lr()[0],
        "grad_norm": grad_norm,
        "tokens": real_tokens,
        "micro_batches": micro_batches,
        "tokens_per_s": real_tokens / elapsed,
        "step_time_s": elapsed,
    }
    efficiency = plan.packing_efficiency(batcher.group_lengths)
    if efficiency is not None:
        metrics["packing_efficiency"] = efficiency
    return metrics
