"""Which samples form each optimizer step, and how a step is cut into micro-batches per rank.

Every rank computes the same schedule from the same lengths and seed, so each
knows the whole step (including the global count of loss tokens used to
normalise the loss) without communicating.

An epoch is a seeded permutation of the samples cut into steps of
``train_batch_size`` samples (the last incomplete step is dropped and
counted, as a DistributedSampler with drop_last does). Inside a step:

* dynamic batching (``max_tokens`` set): the step's groups are bin-packed
  into rows of at most ``max_tokens`` tokens, the pack count is made a
  multiple of the world size, and packs are dealt to ranks with equal counts
  and balanced tokens. The number of micro-batches varies from step to step.
* fixed micro-batches: ``micro_batch_size`` consecutive samples per
  micro-batch, dealt round-robin, the same count every step.

Packing per step (rather than over the whole epoch) keeps a step exactly
``train_batch_size`` samples, as OpenRLHF and TRL users expect; the price is
one part-filled pack per step and rank group, reported as packing efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from openpack.core.packing import deal_to_ranks, plan_packs, shuffled_epoch


@dataclass
class StepPlan:
    """One optimizer step: ``rank_micro_batches[r][m]`` lists the sample ids of rank r's m-th micro-batch."""

    sample_ids: list[int]
    rank_micro_batches: list[list[list[int]]]
    max_tokens: int | None = None

    def real_tokens(self, group_lengths: Sequence[Sequence[int]]) -> int:
        return sum(sum(group_lengths[i]) for i in self.sample_ids)

    def packing_efficiency(self, group_lengths: Sequence[Sequence[int]]) -> float | None:
        """Real tokens / (micro-batches x max_tokens); None without a token cap."""
        if self.max_tokens is None:
            return None
        rows = sum(len(mbs) for mbs in self.rank_micro_batches)
        return self.real_tokens(group_lengths) / (rows * self.max_tokens)


def epoch_steps(num_samples: int, train_batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample ids of each full step of one epoch, in a seeded order new every epoch."""
    if train_batch_size < 1:
        raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
    order = shuffled_epoch(num_samples, seed, epoch)
    full = num_samples // train_batch_size
    return [order[s * train_batch_size:(s + 1) * train_batch_size] for s in range(full)]


def plan_step(
    sample_ids: Sequence[int],
    group_lengths: Sequence[Sequence[int]],
    world_size: int,
    max_tokens: int | None = None,
    micro_batch_size: int | None = None,
) -> StepPlan:
    """Micro-batches of one step for every rank; exactly one of max_tokens / micro_batch_size."""
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError("give exactly one of max_tokens (dynamic batching) or micro_batch_size")
    sample_ids = list(sample_ids)
    if max_tokens is not None:
        plan = plan_packs([group_lengths[i] for i in sample_ids], max_tokens, pack_multiple=world_size)
        per_rank = deal_to_ranks(plan.pack_tokens(), world_size)
        micro = [[[sample_ids[g] for g in plan.packs[p]] for p in packs] for packs in per_rank]
        return StepPlan(sample_ids, micro, max_tokens)
    per_micro = micro_batch_size * world_size
    if len(sample_ids) % per_micro:
        raise ValueError(
            f"a step of {len(sample_ids)} samples does not split into micro-batches of {micro_batch_size} "
            f"on {world_size} ranks; make --train_batch_size a multiple of {per_micro}"
        )
    chunks = [sample_ids[i:i + micro_batch_size] for i in range(0, len(sample_ids), micro_batch_size)]
    return StepPlan(sample_ids, [chunks[r::world_size] for r in range(world_size)])
