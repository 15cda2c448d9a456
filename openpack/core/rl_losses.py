"""The policy losses of PPO-family online RL, per response token, and how tokens are weighed into a step.

Per response token t of completion i, with ratio r_t = exp(logp_t - old_logp_t) and advantage A_t, the policy
loss is one of ``POLICY_LOSSES`` (``--policy_loss_type``)::

    ppo    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)       eps_high > eps_low: DAPO's
                                                                                  clip-higher
    gspo   s_i = exp(mean_t(logp_t - old_logp_t)), one ratio per completion        Zheng et al. 2025 (GSPO),
           s_it = sg[s_i] * exp(logp_t - sg[logp_t])       (value s_i, gradient    the GSPO-token form: per-token
                                                            s_i d logp_t)          advantages (GAE, turn credit)
           loss_t = -min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t)      work; clipped per completion
    cispo  loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_t logp_t          MiniMax-M1 (CISPO): the weight
                                                                                  is clipped, no token's gradient
                                                                                  is dropped

then, in this order::

    dual clip (ppo, gspo; --dual_clip c > 1, A_t < 0):   loss_t = min(loss_t, -c A_t)    Ye et al. 2020: a
                                                          negative advantage's loss is bounded by c |A_t|
    loss_t *= sg[c_t]                                    a rollout correction (--is_correction_type): vLLM
                                                          sampled, the trainer scores; below
    loss_t += kl_coef * kl(logp, ref_logp)               --use_kl_loss (GRPO's KL term)
    loss_t -= entropy_coef * H_t                         --entropy_coef: an entropy bonus (H_t with its gradient)

A rollout correction weighs each token by the trainer/sampler ratio w_t = exp(old_logp_t - behaviour_logp_t) within
[LOW, HIGH] (``--is_correction_threshold``; OpenRLHF 0.11's ``--algo.advantage.is_correction_*``)::

    tis            c_t = clip(w_t, LOW, HIGH)                      truncated importance sampling
    icepop         c_t = w_t if LOW <= w_t <= HIGH, else 0         tokens outside the band are masked
    seq-mask-tis   c_t = clip(w_t, LOW, HIGH) if LOW <= exp(mean_t' log w_t') <= HIGH, else 0: a completion whose
                   geometric-mean ratio is outside the band is masked whole, the rest get token TIS

At the first update of a rollout batch old_logp = sg[logp]: every ratio is 1, GSPO's gradient is the per-token
gradient with each completion's tokens sharing its ratio, and CISPO's is REINFORCE's (A_t d logp_t).

A step's loss is sum_t w_t loss_t over every response token of the step, on
all ranks and micro-batches, with the weights of ``--loss_agg_mode``::

    token_mean                   w_t = 1 / (response tokens in the step)
    seq_mean_token_mean          w_t = 1 / (completions in the step x tokens of t's completion)
    seq_mean_token_sum_norm      w_t = 1 / (completions in the step x generate_max_len)   Dr. GRPO

The step's counts come from the plan, so each micro-batch's part needs no
communication and packing, micro-batching and world size change nothing.

What is per completion (GSPO's s_i, seq-mask-tis's geometric mean, the length in seq_mean_token_mean's weight) is
read from ``Completions``: each token's completion, each completion's whole length, and how a sum over the tokens
at hand becomes the whole completion's. Under ``--ring_attn_size`` a rank holds only part of a completion's tokens;
the trainer's ``total`` then sums the parts over the context group (``models.context_parallel``), so every rank
computes the same s_i as one rank holding the whole row.

The critic's loss per response token, with value v, rollout-time value
v_old and return R from ``gae`` (OpenRLHF's ValueLoss, TRL's PPO)::

    loss_t = 0.5 max((v_old + clip(v - v_old, -value_clip, value_clip) - R)^2, (v - R)^2)
    loss_t = 0.5 (v - R)^2                                                   no --value_clip
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from openpack.core.advantages import kl

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


POLICY_LOSSES = ("ppo", "gspo", "cispo")
IS_CORRECTIONS = ("tis", "icepop", "seq-mask-tis")
DEFAULT_IS_THRESHOLD = (0.5, 5.0)  # OpenRLHF 0.11's --algo.advantage.is_correction_threshold
# The clip ranges a loss uses unless --eps_clip_low_high is given: GSPO's sequence ratios stay near 1, so its paper
# (Zheng et al. 2025, section 5.1) clips them at 3e-4 below and 4e-4 above; CISPO bounds only the weight from above,
# at 5 (MiniMax-M1 sets no lower bound; TRL's epsilon_high 5.0, after ScaleRL). PPO's is --eps_clip (0.2).
DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0)}


@dataclass
class PolicyLossParams:
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0  # > 0 with --use_kl_loss
    kl_estimator: str = "k3"
    loss_type: str = "ppo"  # one of POLICY_LOSSES
    correction: str | None = None  # one of IS_CORRECTIONS; None: the sampler's log-probs are not used
    correction_low: float = 0.0
    correction_high: float = float("inf")
    dual_clip: float | None = None  # > 1: bound a negative advantage's loss at dual_clip x |A| (ppo, gspo)
    entropy_coef: float = 0.0  # > 0: an entropy bonus


def _as_is(sums: Tensor) -> Tensor:
    return sums


@dataclass
class Completions:
    """Which completion each response token at hand belongs to, for what is computed per completion.

    ``ids`` [N] int64: each token's completion (0..S-1); ``lengths`` [S]: each completion's response tokens, all of
    them, also those another rank holds; ``total`` maps per-completion sums over the tokens at hand [S] to sums over
    whole completions (as they are, unless a context group splits completions: ``--ring_attn_size``).
    """

    ids: Tensor
    lengths: Tensor
    total: Callable[[Tensor], Tensor] = field(default=_as_is)

    @staticmethod
    def of(segment_ids: Tensor) -> "Completions":
        """Completions whose tokens are all at hand, ``segment_ids`` [N] naming each token's."""
        return Completions(segment_ids, torch.bincount(segment_ids))

    def mean(self, values: Tensor) -> Tensor:
        """The mean of ``values`` [N] over each whole completion: [S]."""
        sums = torch.zeros(self.lengths.numel(), dtype=values.dtype, device=values.device)
        return self.total(sums.index_add_(0, self.ids, values)) / self.lengths.to(values)


@dataclass
class PolicyTerms:
    """Per-token parts of the loss, each [N] over response tokens."""

    loss: Tensor
    clipped: Tensor  # bool: the ratio (or CISPO's weight) hit its clip range
    tis_clipped: Tensor  # bool: a rollout correction's weight was truncated
    kl: Tensor
    masked: Tensor | None = None  # bool: a rollout correction gave the token weight 0 (icepop, seq-mask-tis)
    is_ratio: Tensor | None = None  # the trainer/sampler ratio w_t, with a rollout correction


def policy_terms(logp: Tensor, old_logp: Tensor, advantages: Tensor, params: PolicyLossParams,
                 ref_logp: Tensor | None = None, behaviour_logp: Tensor | None = None,
                 completions: Completions | None = None, entropy: Tensor | None = None) -> PolicyTerms:
    """The per-token loss of the module docstring; ``ref_logp`` is needed for a KL loss, ``behaviour_logp`` for a
    rollout correction, ``completions`` (each token's completion) for GSPO and seq-mask-tis, ``entropy`` (with
    its gradient) for an entropy bonus."""
    loss, clipped = SURROGATES[params.loss_type](logp, old_logp, advantages, params, completions)
    if params.dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -params.dual_clip * advantages), loss)
    tis_clipped, masked, ratio = torch.zeros_like(loss, dtype=torch.bool), None, None
    if params.correction is not None:
        if behaviour_logp is None:
            raise ValueError("a rollout correction needs the behaviour policy's (vLLM's) log-probs")
        ratio = torch.exp(old_logp - behaviour_logp).detach()
        weight, tis_clipped, masked = rollout_correction(ratio, params, completions)
        loss = loss * weight
    kl_term = torch.zeros_like(loss)
    if ref_logp is not None:
        kl_term = kl(logp, ref_logp, params.kl_estimator)
        if params.kl_coef:
            loss = loss + params.kl_coef * kl_term
    if params.entropy_coef:
        if entropy is None:
            raise ValueError("an entropy bonus needs the tokens' entropy, with its gradient")
        loss = loss - params.entropy_coef * entropy
    return PolicyTerms(loss, clipped, tis_clipped, kl_term.detach(), masked, ratio)


def rollout_correction(ratio: Tensor, params: PolicyLossParams,
                       completions: Completions | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The weight c_t of ``params.correction`` (module docstring) from the ratios w_t [N]: (c_t, truncated,
    masked)."""
    low, high, kind = params.correction_low, params.correction_high, params.correction
    if kind not in IS_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {kind!r}; choose one of {', '.join(IS_CORRECTIONS)}")
    if kind == "icepop":
        keep = (ratio >= low) & (ratio <= high)
        return ratio * keep, torch.zeros_like(keep), ~keep
    truncated = ratio.clamp(low, high)
    if kind == "tis":
        return truncated, truncated != ratio, torch.zeros_like(ratio, dtype=torch.bool)
    if completions is None:
        raise ValueError("seq-mask-tis's geometric mean needs each token's completion (completions)")
    geometric = torch.exp(completions.mean(torch.log(ratio)))
    keep = ((geometric >= low) & (geometric <= high))[completions.ids]
    return truncated * keep, (truncated != ratio) & keep, ~keep


def ppo_surrogate(logp, old_logp, advantages, params, completions=None) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate, per token: (loss_t, clipped_t)."""
    return clipped_surrogate(torch.exp(logp - old_logp), advantages, params)


def gspo_surrogate(logp, old_logp, advantages, params, completions=None) -> tuple[Tensor, Tensor]:
    """GSPO-token: each token carries its completion's ratio s_i (the exp of the mean log-ratio over its tokens)
    as value, and s_i d logp_t as gradient; the clip then acts per completion."""
    if completions is None:
        raise ValueError("GSPO's sequence ratio needs each token's completion (completions)")
    sequence = torch.exp(completions.mean((logp - old_logp).detach()))
    ratio = sequence[completions.ids] * torch.exp(logp - logp.detach())
    return clipped_surrogate(ratio, advantages, params)


def cispo_surrogate(logp, old_logp, advantages, params, completions=None) -> tuple[Tensor, Tensor]:
    """CISPO: the clipped importance weight, detached, times the advantage and the token's log-prob."""
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio.clamp(1 - params.eps_low, 1 + params.eps_high)
    return -weight * advantages * logp, weight != ratio


def clipped_surrogate(ratio: Tensor, advantages: Tensor, params: PolicyLossParams) -> tuple[Tensor, Tensor]:
    """-min(ratio A, clip(ratio) A), and where the clipped branch was taken (the ratio carries no gradient)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - params.eps_low, 1 + params.eps_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


SURROGATES = {"ppo": ppo_surrogate, "gspo": gspo_surrogate, "cispo": cispo_surrogate}


def token_weights(completions: Completions, mode: str, step_tokens: int, step_sequences: int,
                  generate_max_len: int | None = None) -> Tensor:
    """w_t of ``mode`` for each response token [N] (``completions``: each token's, and their whole lengths)."""
    ids = completions.ids
    if mode == "token_mean":
        return torch.full(ids.shape, 1.0 / step_tokens, device=ids.device)
    if mode == "seq_mean_token_mean":
        lengths = completions.lengths.to(ids.device)[ids].double()
        return (1.0 / (step_sequences * lengths)).float()
    if mode == "seq_mean_token_sum_norm":
        if not generate_max_len:
            raise ValueError("seq_mean_token_sum_norm (Dr. GRPO) divides by generate_max_len; give it")
        return torch.full(ids.shape, 1.0 / (step_sequences * generate_max_len), device=ids.device)
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
