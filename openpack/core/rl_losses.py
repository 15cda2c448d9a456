"""The clipped policy loss of PPO-family online RL, per response token, and how tokens are weighed into a step.

Per response token, with ratio rho = exp(logp - old_logp) and advantage A::

    loss_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)         PPO; eps_high > eps_low: DAPO's
                                                                          clip-higher
    loss_t *= min(exp(old_logp - behaviour_logp), cap)                   truncated importance sampling (TIS):
                                                                          vLLM sampled, the trainer scores
    loss_t += kl_coef * kl(logp, ref_logp)                               --use_kl_loss (GRPO's KL term)

A step's loss is sum_t w_t loss_t over every response token of the step, on
all ranks and micro-batches, with the weights of ``--loss_agg_mode``::

    token_mean                   w_t = 1 / (response tokens in the step)
    seq_mean_token_mean          w_t = 1 / (completions in the step x tokens of t's completion)
    seq_mean_token_sum_norm      w_t = 1 / (completions in the step x generate_max_len)   Dr. GRPO

The step's counts come from the plan, so each micro-batch's part needs no
communication and packing, micro-batching and world size change nothing.

The critic's loss per response token, with value v, rollout-time value
v_old and return R from ``gae`` (OpenRLHF's ValueLoss, TRL's PPO)::

    loss_t = 0.5 max((v_old + clip(v - v_old, -value_clip, value_clip) - R)^2, (v - R)^2)
    loss_t = 0.5 (v - R)^2                                                   no --value_clip
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from openpack.core.advantages import kl

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass
class PolicyLossParams:
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0  # > 0 with --use_kl_loss
    kl_estimator: str = "k3"
    tis_cap: float = 0.0  # 0: no truncated importance sampling


@dataclass
class PolicyTerms:
    """Per-token parts of the loss, each [N] over response tokens."""

    loss: Tensor
    clipped: Tensor  # bool: the clipped branch was taken (the token carries no gradient from the ratio)
    tis_clipped: Tensor  # bool: the importance weight hit its cap
    kl: Tensor


def policy_terms(logp: Tensor, old_logp: Tensor, advantages: Tensor, params: PolicyLossParams,
                 ref_logp: Tensor | None = None, behaviour_logp: Tensor | None = None) -> PolicyTerms:
    """The per-token loss of the module docstring; ``ref_logp`` is needed for a KL loss, ``behaviour_logp`` for TIS."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - params.eps_low, 1 + params.eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    tis_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if params.tis_cap:
        if behaviour_logp is None:
            raise ValueError("truncated importance sampling needs the behaviour policy's (vLLM's) log-probs")
        weight = torch.exp(old_logp - behaviour_logp)
        tis_clipped = weight > params.tis_cap
        loss = loss * weight.clamp(max=params.tis_cap).detach()
    kl_term = torch.zeros_like(loss)
    if ref_logp is not None:
        kl_term = kl(logp, ref_logp, params.kl_estimator)
        if params.kl_coef:
            loss = loss + params.kl_coef * kl_term
    return PolicyTerms(loss, clipped < unclipped, tis_clipped, kl_term.detach())


def token_weights(segment_ids: Tensor, mode: str, step_tokens: int, step_sequences: int,
                  generate_max_len: int | None = None) -> Tensor:
    """w_t of ``mode`` for each response token [N] (``segment_ids`` names each token's completion)."""
    if mode == "token_mean":
        return torch.full(segment_ids.shape, 1.0 / step_tokens, device=segment_ids.device)
    if mode == "seq_mean_token_mean":
        lengths = torch.bincount(segment_ids)[segment_ids].double()
        return (1.0 / (step_sequences * lengths)).float()
    if mode == "seq_mean_token_sum_norm":
        if not generate_max_len:
            raise ValueError("seq_mean_token_sum_norm (Dr. GRPO) divides by generate_max_len; give it")
        return torch.full(segment_ids.shape, 1.0 / (step_sequences * generate_max_len), device=segment_ids.device)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


@dataclass
class ValueTerms:
    """Per-token parts of the critic's loss, each [N] over response tokens."""

    loss: Tensor
    clipped: Tensor  # bool: the clipped branch was larger (the token's gradient comes through the clipped value)


def value_terms(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None) -> ValueTerms:
    """The critic's per-token loss of the module docstring; ``value_clip`` None or 0: no clipping."""
    unclipped = (values - returns).square()
    if not value_clip:
        return ValueTerms(0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool))
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns).square()
    return ValueTerms(0.5 * torch.maximum(clipped, unclipped), clipped > unclipped)
