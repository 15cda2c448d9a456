"""The DPO-family step: pairs packed as two isolated segments, loss averaged over the step's pairs.

A pair (chosen, rejected) is one packing group, so both land in the same
micro-batch; chosen and rejected are told apart by the segment table. For a
step of N pairs over all micro-batches and ranks, each micro-batch hands
``backward`` ``sum(pair losses) / N`` times the world size (undoing
DeepSpeed's average over ranks). That is the gradient of the mean over the
step's pairs whatever the packing, micro-batch layout or world size (the
normalisation TRL applies to one batch, and OpenRLHF per micro-batch).
With ``--fused_loss`` the engine returns that loss from the LM head directly,
each pair's logits computed once (``core/fused_loss.py``); the numbers are the same.
Under ``--ring_attn_size N`` a rank holds part of each segment: its log-prob
sums (and label counts) are summed over the context group before the loss, so
the N ranks compute the same pair losses, each with the same ``scale``; the
gradient passes to each rank's part unchanged (``models.context_parallel``),
and DeepSpeed's sum over the world adds the parts. The pairs are counted in
the metrics once per group.
An MoE policy adds its router load-balancing loss, each micro-batch's weighted by
its tokens (``trainers/router_aux.py``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from openpack.core.batch import host_to_device
from openpack.core.fused_loss import FusedLoss
from openpack.core.logprobs import pair_segments, segment_label_counts, segment_logprobs
from openpack.core.losses import LossParams, PairLogps, implicit_rewards, pair_losses
from openpack.core.schedule import RankStep
from openpack.distributed.engine import optimizer_step
from openpack.distributed.process import DistInfo
from openpack.models.context_parallel import whole_segment_values
from openpack.trainers.batching import MicroBatcher, step_metrics
from openpack.trainers.metrics import DeviceSums, StepMetrics
from openpack.trainers.router_aux import RouterAux

STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
         "logps/chosen", "logps/rejected")


@dataclass
class PreferenceObjective:
    """Which losses, with which weights and parameters; ``reference`` is None for reference-free losses."""

    loss_types: list[str]
    loss_weights: list[float]
    params: LossParams
    reference: object | None  # ModelReference or CachedReference
    fused: bool = False  # --fused_loss


class PairTable:
    """Where each pair of a micro-batch sits in its segment table, found once on the host; maps per-segment
    sums [S] to ``PairLogps`` with no device sync (the fused loss calls it once per chunk)."""

    def __init__(self, batch, device):
        _, chosen, rejected = pair_segments(batch)
        self.chosen, self.rejected = host_to_device(chosen, device), host_to_device(rejected, device)
        self.counts = whole_segment_values(batch, host_to_device(segment_label_counts(batch), device))

    def logps(self, sums: torch.Tensor, ref_sums: torch.Tensor | None) -> PairLogps:
        """Per-pair sums (and token counts), policy and reference (None: reference-free)."""
        c, r = self.chosen, self.rejected
        ref_chosen, ref_rejected = (None, None) if ref_sums is None else (ref_sums[c], ref_sums[r])
        return PairLogps(sums[c], sums[r], ref_chosen, ref_rejected, self.counts[c], self.counts[r])


@torch.no_grad()
def pair_stats(logps: PairLogps, losses: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    """Sums over the micro-batch's pairs of each STATS entry, on the device (means are taken over the whole step)."""
    reward_chosen, reward_rejected = implicit_rewards(logps, beta)
    return {"loss": losses.sum(), "rewards/chosen": reward_chosen.sum(), "rewards/rejected": reward_rejected.sum(),
            "rewards/margins": (reward_chosen - reward_rejected).sum(),
            "rewards/accuracies": (reward_chosen > reward_rejected).float().sum(),
            "logps/chosen": logps.chosen.sum(), "logps/rejected": logps.rejected.sum()}


def dpo_step(engine, batcher: MicroBatcher, objective: PreferenceObjective, step: RankStep,
             dist: DistInfo) -> StepMetrics:
    start = time.perf_counter()
    pairs = step.samples
    # The sft term is a token mean over the step's chosen tokens (as TRL's is over its batch), counted by the plan.
    chosen_tokens = step.label_tokens[-2]  # a pair's segments: (chosen, rejected), or (prompt, chosen, rejected)
    params = dataclasses.replace(objective.params, sft_tokens_per_pair=chosen_tokens / pairs)
    micro_batches = batcher.collate(step.micro_batches)
    router_aux = RouterAux(engine, step.real_tokens)
    sums, grad_norm = DeviceSums(STATS + router_aux.names, dist.device), None
    scale = dist.world_size / pairs
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        table, host_batch, tokens = PairTable(batch, dist.device), batch, batch.num_tokens
        batch = batch.to(dist.device)
        ref_sums = None if objective.reference is None else objective.reference.segment_sums(batch).to(dist.device)

        def evaluate(segment_sums: torch.Tensor) -> tuple[PairLogps, torch.Tensor]:
            logps = table.logps(segment_sums, ref_sums)
            return logps, pair_losses(logps, params, objective.loss_types, objective.loss_weights)

        if objective.fused:  # the head, the loss and its gradients in one pass (core/fused_loss.py)
            fused = FusedLoss(lambda segment_sums: evaluate(segment_sums)[1].sum() * scale, host_batch.labels,
                              host_batch.sample_index[host_batch.segment_ids])  # chunks of whole pairs
            loss, segment_sums = engine(batch, fused=fused)
            logps, losses = evaluate(segment_sums)
        else:
            logps, losses = evaluate(whole_segment_values(batch, segment_logprobs(batch, engine(batch)).sum))
            loss = losses.sum() * scale
        aux_loss, aux_sums = router_aux.term(tokens)  # after the policy's forward, not the reference's
        engine.backward(loss + aux_loss * dist.world_size)
        sums.add(**batcher.context.counted(pair_stats(logps, losses, objective.params.beta)), **aux_sums)
        grad_norm = optimizer_step(engine, sums.get("loss") / pairs) if last else engine.step()
    return step_metrics(step, engine, grad_norm, sums, lambda totals: {
        **{name: totals[name] / pairs for name in STATS}, "pairs": pairs, **router_aux.metrics(totals)},
        start, {"pairs_per_s": pairs})
