"""The SFT step loop: exact token-mean loss over the whole step, whatever the batching.

For a step with N loss tokens over all micro-batches and ranks, every
micro-batch contributes ``-sum(log p) / N``. DeepSpeed averages gradients
over the W data-parallel ranks, so each rank hands ``backward`` its share
times W. The gradient is then that of the mean over the step's tokens, for
any number or size of micro-batches and any world size (the invariance tests
check packed == padded, 1x8 == 8x1 and 1 == 2 ranks). Weighting micro-batches
equally instead is the bug of verl #5625. With ``--fused_loss`` the engine
returns that loss from the LM head directly, each chunk's logits computed once
(``core/fused_loss.py``); the numbers are the same. An MoE model adds its router
load-balancing loss, each micro-batch's weighted by its tokens (``trainers/router_aux.py``).
"""

from __future__ import annotations

import time

from openpack.core.fused_loss import FusedLoss
from openpack.distributed.engine import optimizer_step
from openpack.distributed.process import DistInfo
from openpack.core.schedule import RankStep
from openpack.trainers.batching import MicroBatcher, step_metrics
from openpack.trainers.metrics import DeviceSums, StepMetrics
from openpack.trainers.router_aux import RouterAux


def train_step(engine, batcher: MicroBatcher, step: RankStep, dist: DistInfo, fused: bool = False) -> StepMetrics:
    """Forward/backward over this rank's micro-batches of one step, then one optimizer step; the loss stays on the
    device until the step is logged (``trainers/metrics.py``). ``fused``: --fused_loss."""
    start = time.perf_counter()
    (denominator,) = step.label_tokens  # the step's loss tokens over every rank, from the plan
    micro_batches = batcher.collate(step.micro_batches)
    router_aux = RouterAux(engine, step.real_tokens)
    sums, grad_norm = DeviceSums(("nll", *router_aux.names), dist.device), None
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        host_labels, tokens = batch.labels, batch.num_tokens
        batch = batch.to(dist.device)
        if fused:  # the NLL is linear in the segments' sums: chunks may cut anywhere
            loss, segment_sums = engine(batch, fused=FusedLoss(
                lambda sums: -sums.sum() * dist.world_size / denominator, host_labels))
            nll = -segment_sums.sum()
        else:
            nll = -(engine(batch) * batch.loss_mask.reshape(-1)).sum()
            loss = nll * dist.world_size / denominator
        aux_loss, aux_sums = router_aux.term(tokens)
        engine.backward(loss + aux_loss * dist.world_size)
        sums.add(nll=nll, **aux_sums)
        if last:  # applied only if the step's loss over every rank and its grad norm are finite
            grad_norm = optimizer_step(engine, sums.get("nll") / denominator)
        else:
            engine.step()  # not a boundary: DeepSpeed only counts the micro-step
    return step_metrics(step, engine, grad_norm, sums, lambda total: {
        "loss": total["nll"] / denominator, "loss_tokens": denominator, "samples": step.samples,
        **router_aux.metrics(total)}, start)
