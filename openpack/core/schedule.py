"""Which samples form each optimizer step, and how a step is cut into micro-batches per rank.

The whole run is planned once, from lengths only (``plan_run``): under Ray
the driver plans and sends each rank its ``RankPlan``; one process or
torchrun ranks plan for themselves (the same deterministic result). A rank's
plan lists, for every step, the sample ids of its micro-batches and the
step's totals over all ranks (samples, real tokens, label tokens per segment
role, rows), so the loss normaliser needs no communication and a rank never
needs another rank's samples.

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

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from openpack.core.packing import deal_to_ranks, plan_packs, shuffled_epoch


@dataclass
class StepPlan:
    """One optimizer step: ``rank_micro_batches[r][m]`` lists the sample ids of rank r's m-th micro-batch."""

    sample_ids: list[int]
    rank_micro_batches: list[list[list[int]]]
    max_tokens: int | None = None

    def real_tokens(self, group_lengths: Sequence[Sequence[int]]) -> int:
        return int(sum(sum(group_lengths[i]) for i in self.sample_ids))


@dataclass
class RankStep:
    """What one rank needs of a step: its micro-batches, and the step's totals over all ranks."""

    epoch: int
    index: int  # the step's place in its epoch
    micro_batches: list[list[int]]
    samples: int
    real_tokens: int
    label_tokens: tuple[int, ...]  # over the step's samples, per segment position (SFT: one; a pair: chosen, rejected;
    #                               --prefix_sharing: prompt, chosen, rejected)
    rows: int  # micro-batches over all ranks
    max_tokens: int | None
    digest: str = ""  # what the step trains on, the same on every rank and layout (``step_digest``)

    @property
    def packing_efficiency(self) -> float | None:
        """Real tokens / (rows x max_tokens); None without a token cap."""
        return None if self.max_tokens is None else self.real_tokens / (self.rows * self.max_tokens)


@dataclass
class RankPlan:
    """Everything one rank is told about the data: the run's steps, and which rows its sample ids are."""

    steps: list[RankStep]
    rows: Sequence[int]  # rows[i]: the row sample id i is (a global row id, ``data/loading.py``; a numpy array)
    fingerprint: str  # identity of the tokenized data (keys the reference log-prob cache)
    datasets: list[str]  # where the rows are (--dataset, or the demo's files)
    scoring: list[list[int]] | None = None  # this rank's share of every sample once (a reference pass)

    @property
    def num_samples(self) -> int:
        return len(self.rows)

    def sample_ids(self) -> list[int]:
        """Every sample id this rank will see, in its steps or its scoring share."""
        ids = {i for step in self.steps for mb in step.micro_batches for i in mb}
        ids.update(i for mb in self.scoring or [] for i in mb)
        return sorted(ids)


@dataclass
class Batching:
    """How a step becomes micro-batches: token-capped packs (``max_tokens``) or ``micro_batch_size`` samples."""

    max_tokens: int | None = None
    micro_batch_size: int | None = None


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


def step_digest(sample_ids: Sequence[int], group_lengths: Sequence[Sequence[int]]) -> str:
    """16 hex digits naming the samples of one step: their ids (sorted) and segment lengths.

    Micro-batching, packing and the world size leave it unchanged (they never change a step's loss);
    another batch size, seed, data order, ``max_len`` or tokenization changes it. A checkpoint keeps the
    digests of the steps it has taken, so a resume can tell whether the new plan continues them.
    """
    key = repr([(i, tuple(int(n) for n in group_lengths[i])) for i in sorted(sample_ids)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def total_steps(num_samples: int, train_batch_size: int, max_epochs: int, max_steps: int | None) -> int:
    full = num_samples // train_batch_size * max_epochs
    return min(full, max_steps) if max_steps else full


def plan_run(
    group_lengths: Sequence[Sequence[int]],
    group_labels: Sequence[Sequence[int]],
    world_size: int,
    batching: Batching,
    train_batch_size: int,
    max_epochs: int,
    max_steps: int | None,
    seed: int,
) -> list[list[RankStep]]:
    """Every step of the run, as each rank sees it: ``plan_run(...)[rank][global_step]``.

    ``group_lengths[i]`` / ``group_labels[i]``: tokens and label tokens of
    sample i's segments (lists, or a numpy array [samples, segments]: the
    driver's, 8 bytes a segment).
    """
    last = total_steps(len(group_lengths), train_batch_size, max_epochs, max_steps)
    ranks: list[list[RankStep]] = [[] for _ in range(world_size)]
    epoch = 0
    while len(ranks[0]) < last:
        for index, sample_ids in enumerate(epoch_steps(len(group_lengths), train_batch_size, seed, epoch)):
            if len(ranks[0]) == last:
                break
            step = plan_step(sample_ids, group_lengths, world_size, batching.max_tokens, batching.micro_batch_size)
            labels = tuple(int(n) for n in map(sum, zip(*(group_labels[i] for i in sample_ids))))
            rows = sum(len(mbs) for mbs in step.rank_micro_batches)
            digest = step_digest(sample_ids, group_lengths)
            for rank, micro_batches in enumerate(step.rank_micro_batches):
                ranks[rank].append(RankStep(epoch, index, micro_batches, len(sample_ids),
                                            step.real_tokens(group_lengths), labels, rows, batching.max_tokens,
                                            digest))
        epoch += 1
    return ranks


def plan_scoring(group_lengths: Sequence[Sequence[int]], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Every sample once, packed into rows of ``max_tokens`` (at least the longest group), dealt to ranks."""
    totals = group_lengths.sum(axis=1) if isinstance(group_lengths, np.ndarray) else map(sum, group_lengths)
    cap = max(max_tokens, int(max(totals, default=0)))
    return plan_step(range(len(group_lengths)), group_lengths, world_size, max_tokens=cap).rank_micro_batches
