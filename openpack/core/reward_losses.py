"""Pairwise reward-model losses (Bradley-Terry) behind a registry keyed by name, as the DPO losses are.

A reward model gives each sequence one scalar, read at its last token. Per
pair, with c and r the rewards of chosen and rejected and m the pair's margin
(``--margin_key``, 0 without one)::

    sigmoid   -logsig(c - r - m)      TRL's RewardTrainer, OpenRLHF's PairWiseLoss (Llama 2's margin)
    logexp    log(1 + exp(r - c))     OpenRLHF's LogExpLoss; the same function as sigmoid without a
                                      margin, which it does not take

``center_rewards_coefficient`` (TRL's, from Eisenstein et al. 2023) adds
``coef * (c + r)^2`` per pair, pulling rewards towards zero mean. A trainer
divides the sum over a step's pairs by the step's global pair count, so the
loss is the mean over the step whatever the packing (TRL takes the same mean
over its batch).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

RewardLossFn = Callable[[Tensor, Tensor, Tensor], Tensor]
REWARD_LOSSES: dict[str, RewardLossFn] = {
    "sigmoid": lambda chosen, rejected, margin: -F.logsigmoid(chosen - rejected - margin),
    "logexp": lambda chosen, rejected, margin: F.softplus(rejected - chosen),
}
TAKES_MARGIN = {"sigmoid"}


def reward_pair_losses(chosen: Tensor, rejected: Tensor, loss: str = "sigmoid", margin: Tensor | None = None,
                       center_rewards_coefficient: float = 0.0) -> Tensor:
    """Per-pair loss ``[P]`` from the rewards ``[P]`` of chosen and rejected (and each pair's margin ``[P]``)."""
    if loss not in REWARD_LOSSES:
        raise ValueError(f"unknown reward loss {loss!r}; registered: {', '.join(sorted(REWARD_LOSSES))}")
    if margin is not None and loss not in TAKES_MARGIN:
        raise ValueError(f"reward loss {loss!r} takes no margin; use one of {sorted(TAKES_MARGIN)}")
    margin = torch.zeros_like(chosen) if margin is None else margin.to(chosen.dtype)
    losses = REWARD_LOSSES[loss](chosen, rejected, margin)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses
