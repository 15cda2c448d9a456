"""The reward-model step: pairs packed as two isolated segments, one reward each, loss averaged over the step's pairs.

A pair (chosen, rejected) is one packing group, as in DPO; each segment's
reward is the value head at its last token, and chosen and rejected are told
apart by the segment table. For a step of N pairs over all micro-batches and
ranks, each micro-batch hands ``backward`` ``sum(pair losses) / N`` times the
world size (undoing DeepSpeed's average over ranks): the gradient of the mean
over the step's pairs, whatever the packing, micro-batch layout or world size.
Under ``--ring_attn_size N`` the engine returns every reward of the row on each
of the N ranks (read where the last token is, summed over the context group:
``models/reward.py``), so they compute the same losses; the pairs are counted
in the metrics once per group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from openpack.core.batch import host_to_device
from openpack.core.logprobs import pair_segments
from openpack.core.reward_losses import reward_pair_losses
from openpack.core.schedule import RankStep
from openpack.distributed.engine import optimizer_step
from openpack.distributed.process import DistInfo
from openpack.trainers.batching import MicroBatcher, step_metrics
from openpack.trainers.metrics import DeviceSums, StepMetrics

# TRL's RewardTrainer names where it has them; means over the step's pairs.
STATS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")


@dataclass
class RewardObjective:
    """Which loss, the centering weight, and each pair's margin by sample id (None: no margins)."""

    loss: str
    center_rewards_coefficient: float
    margins: torch.Tensor | None  # [num samples] fp32


@torch.no_grad()
def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, losses: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the micro-batch's pairs of each STATS entry, on the device (means are taken over the whole step)."""
    return {"loss": losses.sum(), "accuracy": (chosen > rejected).float().sum(), "margin": (chosen - rejected).sum(),
            "rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum()}


def rm_step(engine, batcher: MicroBatcher, objective: RewardObjective, step: RankStep,
            dist: DistInfo) -> StepMetrics:
    start = time.perf_counter()
    pairs = step.samples
    sums, grad_norm = DeviceSums(STATS, dist.device), None
    # on the device once per step: a margin is then looked up by device ids, with no copy per micro-batch
    margins = None if objective.margins is None else objective.margins.to(dist.device)
    micro_batches = batcher.collate(step.micro_batches)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        ids, chosen_segments, rejected_segments = (host_to_device(t, dist.device) for t in pair_segments(batch))
        batch = batch.to(dist.device)
        rewards = engine(batch)  # one reward per segment -> per pair, found on the host
        chosen, rejected = rewards[chosen_segments], rewards[rejected_segments]
        margin = None if margins is None else margins[ids]
        losses = reward_pair_losses(chosen, rejected, objective.loss, margin, objective.center_rewards_coefficient)
        engine.backward(losses.sum() * dist.world_size / pairs)
        sums.add(**batcher.context.counted(pair_stats(chosen, rejected, losses)))
        grad_norm = optimizer_step(engine, sums.get("loss") / pairs) if last else engine.step()
    return step_metrics(step, engine, grad_norm, sums,
                        lambda totals: {**{name: totals[name] / pairs for name in STATS}, "pairs": pairs},
                        start, {"pairs_per_s": pairs})
