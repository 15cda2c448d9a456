"""Preference losses (DPO family) behind a registry keyed by name.

A trainer looks a loss up by name (``pair_losses(logps, params, ["sigmoid"])``)
and never branches on the loss type. Every loss maps per-pair sums of
label-token log-probs to a per-pair loss ``[P]``; the trainer divides the sum
of those over a whole step by the step's global pair count (DESIGN.md,
"Losses and normalisation"). That is the trade-off against TRL, which takes a
mean per micro-batch: the two agree when every micro-batch holds the same
number of pairs; under packing micro-batches hold different numbers of pairs,
and only the global mean keeps the loss independent of how pairs are split.

Notation, per pair (beta = ``LossParams.beta``, eps = ``label_smoothing``,
n_c / n_r = label tokens of the chosen / rejected response):

    c = chosen - ref_chosen            r = rejected - ref_rejected
    h = c - r                          logsig = log(sigmoid(.))

    sigmoid      -(1 - eps) logsig(beta h) - eps logsig(-beta h)        (DPO; eps > 0: cDPO)
    ipo          (c / n_c - r / n_r - 1 / (2 beta))^2                   (IPO, length-normalised as TRL)
    hinge        max(0, 1 - beta h)                                     (SLiC)
    robust       (-(1 - eps) logsig(beta h) + eps logsig(-beta h)) / (1 - 2 eps)
    simpo        z = beta (chosen / n_c - rejected / n_r) - simpo_gamma
                 -(1 - eps) logsig(z) - eps logsig(-z)                  (reference-free)
    sft          -chosen / (mean of n_c over the step's pairs)          (reference-free; the
                 step's mean over pairs is the token-mean NLL of all chosen tokens)
    nca_pair     -logsig(beta c) - 0.5 logsig(-beta c) - 0.5 logsig(-beta r)
    bco_pair     -logsig(beta c) - logsig(-beta r)
    sppo_hard    (c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2
    apo_zero     1 - sigmoid(beta c) + sigmoid(beta r)
    apo_down     sigmoid(beta c) + 1 - sigmoid(beta h)
    exo_pair     q = sigmoid(beta h):  q (log q - log(1 - eps)) + (1 - q) (log(1 - q) - log eps)
    sigmoid_norm -logsig(beta (c / n_c - r / n_r))

With policy == reference and beta = 0.1 (TRL's step-1 values): sigmoid ln 2,
hinge 1, ipo 25, sppo_hard 50, nca_pair and bco_pair 2 ln 2, apo_zero and
apo_down 1.

Every loss TRL 1.16 also has matches its default path (``f_divergence_type=
"reverse_kl"``, ``ld_alpha=None``, ``use_weighting=False``) exactly; each
function names the TRL code it matches. Not registered: TRL's ``aot`` and
``aot_unpaired`` sort log-ratios across the micro-batch, so they are no
per-pair loss and change with micro-batching; ``discopop`` needs its own
temperature and is rarely used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PairLogps:
    """Per-pair sums of label-token log-probs, each ``[P]`` fp32."""

    chosen: Tensor  # policy, sum over chosen response tokens
    rejected: Tensor
    ref_chosen: Tensor | None  # reference model; None for reference-free losses
    ref_rejected: Tensor | None
    chosen_tokens: Tensor  # number of label tokens of each chosen response, [P]
    rejected_tokens: Tensor


@dataclass
class LossParams:
    """Hyper-parameters of the losses; names as TRL's DPOConfig/CPOConfig and OpenRLHF's flags.

    ``sft_tokens_per_pair`` is the one per-step value: a trainer that splits a
    step over micro-batches or ranks sets it (``dataclasses.replace``) to the
    step's chosen label tokens / pairs, so ``sft`` is a token mean over the step.
    """

    beta: float = 0.1
    """Inverse temperature of the implicit reward (IPO's tau, SimPO's beta)."""
    label_smoothing: float = 0.0
    """Probability a preference label is flipped: sigmoid (cDPO), simpo, robust [0, 0.5), exo_pair (0, 1)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    sft_tokens_per_pair: float | None = None
    """Chosen label tokens per pair over the whole step, all ranks; None: the mean over the pairs passed in."""


LossFn = Callable[[PairLogps, LossParams], Tensor]
PAIR_LOSSES: dict[str, LossFn] = {}
LOSS_SUMMARIES: dict[str, str] = {}  # name -> one line for --help
REFERENCE_FREE: set[str] = set()


def register_loss(name: str, summary: str, *, reference_free: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator: add ``fn(logps, params) -> [P]`` to ``PAIR_LOSSES`` under ``name``, described by ``summary``."""

    def add(fn: LossFn) -> LossFn:
        if name in PAIR_LOSSES:
            raise ValueError(f"loss {name!r} is already registered (by {PAIR_LOSSES[name].__name__})")
        PAIR_LOSSES[name] = fn
        LOSS_SUMMARIES[name] = summary
        if reference_free:
            REFERENCE_FREE.add(name)
        return fn

    return add


def _lookup(name: str) -> LossFn:
    if name not in PAIR_LOSSES:
        raise ValueError(f"unknown loss type {name!r}; registered: {', '.join(sorted(PAIR_LOSSES))}")
    return PAIR_LOSSES[name]


def pair_losses(
    logps: PairLogps,
    params: LossParams,
    loss_types: Sequence[str],
    weights: Sequence[float] | None = None,
) -> Tensor:
    """Weighted sum of the named losses, per pair ``[P]`` (TRL's ``loss_type`` list with ``loss_weights``)."""
    if isinstance(loss_types, str):
        loss_types = [loss_types]
    if not loss_types:
        raise ValueError("loss_types is empty; name at least one loss, e.g. ['sigmoid']")
    weights = [1.0] * len(loss_types) if weights is None else list(weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"got {len(weights)} loss weights for {len(loss_types)} loss types {list(loss_types)}")
    fns = [_lookup(name) for name in loss_types]  # all names checked before any compute
    return sum(w * fn(logps, params) for fn, w in zip(fns, weights))


def needs_reference(loss_types: Sequence[str]) -> bool:
    """False only if every named loss is reference-free (``simpo``, ``sft``)."""
    if isinstance(loss_types, str):
        loss_types = [loss_types]
    for name in loss_types:
        _lookup(name)  # an unknown name is an error here too, not a silent "needs one"
    return any(name not in REFERENCE_FREE for name in loss_types)


def implicit_rewards(logps: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """``beta * (policy - ref)`` for chosen and rejected, ``[P]`` each, detached.

    TRL's ``rewards/chosen`` and ``rewards/rejected`` are their means over pairs.
    Without a reference (simpo, sft) the reference counts as 0, as TRL's CPO
    logs ``beta * policy`` (CPO uses per-token averages for simpo; sums here).
    """
    if logps.ref_chosen is None or logps.ref_rejected is None:
        return beta * logps.chosen.detach(), beta * logps.rejected.detach()
    chosen, rejected = _logratios(logps, "implicit_rewards")
    return beta * chosen.detach(), beta * rejected.detach()


def _logratios(logps: PairLogps, name: str) -> tuple[Tensor, Tensor]:
    if logps.ref_chosen is None or logps.ref_rejected is None:
        raise ValueError(
            f"{name} needs reference log-probs but PairLogps.ref_chosen/ref_rejected are None; "
            "compute them with the reference model, or use a reference-free loss (simpo, sft)"
        )
    return logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected


def _per_token(value: Tensor, tokens: Tensor) -> Tensor:
    # clamp(min=1) as TRL does for ipo/sigmoid_norm: an empty response gives 0, not nan.
    return value / tokens.clamp(min=1).to(value.dtype)


def _smoothed_logistic(z: Tensor, eps: float) -> Tensor:
    """Binary cross-entropy of sigmoid(z) against the soft label 1 - eps."""
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


# TRL 1.16 trainer/dpo_trainer.py, DPOTrainer._compute_loss, loss_type == "sigmoid".
# TRL 1.16's DPO sigmoid ignores label_smoothing (it documents eps only for
# robust and exo_pair); here eps > 0 gives conservative DPO (cDPO, Mitchell 2023),
# as OpenRLHF's --label_smoothing and TRL's CPO "sigmoid" do. eps = 0: identical.
@register_loss("sigmoid", "DPO's logistic loss on the reward margin (Rafailov et al. 2023); --label_smoothing > 0: cDPO")
def sigmoid_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "sigmoid")
    return _smoothed_logistic(params.beta * (chosen - rejected), params.label_smoothing)


# TRL 1.16 dpo_trainer.py, _compute_loss, "ipo". TRL divides each log-ratio by
# its response's completion-token count (confirmed with the IPO authors, per
# TRL's comment), so beta is comparable across lengths; eq. 17 of 2310.12036.
# TRL counts the unshifted completion_mask: the same as our label tokens unless
# a response starts at position 0 (an empty prompt).
@register_loss("ipo", "IPO: squared distance of the length-normalised margin from 1/(2 beta) (Azar et al. 2023)")
def ipo_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "ipo")
    delta = _per_token(chosen, logps.chosen_tokens) - _per_token(rejected, logps.rejected_tokens)
    return (delta - 1 / (2 * params.beta)) ** 2


# TRL 1.16 dpo_trainer.py, _compute_loss, "hinge": beta scales h inside the
# hinge, margin 1 (SLiC, 2305.10425); label_smoothing unused.
@register_loss("hinge", "SLiC's hinge on the margin: max(0, 1 - beta h) (Zhao et al. 2023)")
def hinge_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "hinge")
    return torch.relu(1 - params.beta * (chosen - rejected))


# TRL 1.16 dpo_trainer.py, _compute_loss, "robust" (rDPO, 2403.00409):
# an unbiased estimate of the clean-label loss under flip rate eps.
@register_loss("robust", "robust DPO, unbiased under --label_smoothing flipped labels (Chowdhury et al. 2024)")
def robust_loss(logps: PairLogps, params: LossParams) -> Tensor:
    eps = params.label_smoothing
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"robust loss needs label_smoothing in [0, 0.5), got {eps}; set --label_smoothing")
    chosen, rejected = _logratios(logps, "robust")
    z = params.beta * (chosen - rejected)
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


# TRL 1.16 experimental/cpo/cpo_trainer.py, CPOTrainer.cpo_loss, "simpo" with
# AlphaPO's alpha = 0; averages as CPOTrainer.get_batch_logps(average_log_prob=True)
# (SimPO, 2405.14734). TRL writes beta * (avg_c - avg_r - gamma / beta),
# equal to z up to rounding. TRL's CPO adds cpo_alpha (default 1) times the
# chosen NLL; that is pair_losses(..., ["simpo", "sft"], [1, cpo_alpha]) here,
# and pure SimPO is cpo_alpha = 0. TRL divides by the token count without a clamp.
@register_loss("simpo", "SimPO: length-normalised margin minus --simpo_gamma, no reference model (Meng et al. 2024)", reference_free=True)
def simpo_loss(logps: PairLogps, params: LossParams) -> Tensor:
    avg_chosen = _per_token(logps.chosen, logps.chosen_tokens)
    avg_rejected = _per_token(logps.rejected, logps.rejected_tokens)
    z = params.beta * (avg_chosen - avg_rejected) - params.simpo_gamma
    return _smoothed_logistic(z, params.label_smoothing)


# TRL 1.16 dpo_trainer.py, _compute_loss, "sft": the NLL of all chosen tokens
# of the batch, token-mean over the batch (not a mean of per-response means),
# copied to every pair. Per pair we return -chosen_i / mean_tokens, whose mean
# over the pairs is -sum(chosen) / sum(n_c): TRL's value exactly when the pairs
# are one TRL batch. With sft_tokens_per_pair set to the step's global value,
# the trainer's global pair mean is the token mean over the whole step, so
# micro-batching and packing leave it unchanged (TRL's mean of per-micro-batch
# token means does not). Per-pair values differ from TRL's; only the mean matches.
@register_loss("sft", "NLL of the chosen responses, a token mean over the step (what --nll_loss_coef adds)", reference_free=True)
def sft_loss(logps: PairLogps, params: LossParams) -> Tensor:
    tokens = params.sft_tokens_per_pair
    if tokens is None:
        tokens = logps.chosen_tokens.to(logps.chosen.dtype).mean()
    tokens = torch.as_tensor(tokens, dtype=logps.chosen.dtype, device=logps.chosen.device)
    # No chosen tokens at all means every chosen sum is 0: return 0, not nan.
    return -logps.chosen / tokens.clamp(min=1e-12)


# TRL 1.16 dpo_trainer.py, _compute_loss, "nca_pair" (NCA, 2402.05369).
@register_loss("nca_pair", "NCA: noise-contrastive alignment on absolute rewards (Chen et al. 2024)")
def nca_pair_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "nca_pair")
    c, r = params.beta * chosen, params.beta * rejected
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)


# TRL 1.16 dpo_trainer.py, _compute_loss, "bco_pair": TRL 1.16 has no running
# reward-shift delta here, so the loss is per pair.
@register_loss("bco_pair", "BCO: binary classification of chosen vs rejected rewards (Jung et al. 2024)")
def bco_pair_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "bco_pair")
    return -F.logsigmoid(params.beta * chosen) - F.logsigmoid(-params.beta * rejected)


# TRL 1.16 dpo_trainer.py, _compute_loss, "sppo_hard" (SPPO 2405.00675 with
# hard win probabilities 1 / 0): log-ratios regressed to +-1 / (2 beta).
@register_loss("sppo_hard", "SPPO with hard labels: squared rewards towards +-1/(2 beta) (Wu et al. 2024)")
def sppo_hard_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "sppo_hard")
    target = 0.5 / params.beta
    return (chosen - target) ** 2 + (rejected + target) ** 2


# TRL 1.16 dpo_trainer.py, _compute_loss, "apo_zero" (APO 2408.06266 eq. 7):
# chosen better than the model's own output; raise chosen, lower rejected.
@register_loss("apo_zero", "APO-zero: raise chosen, lower rejected likelihood (D'Oosterlinck et al. 2024)")
def apo_zero_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "apo_zero")
    return 1 - torch.sigmoid(params.beta * chosen) + torch.sigmoid(params.beta * rejected)


# TRL 1.16 dpo_trainer.py, _compute_loss, "apo_down" (APO eq. 8): chosen worse
# than the model's own output; lower both, rejected more.
@register_loss("apo_down", "APO-down: lower both, rejected more (D'Oosterlinck et al. 2024)")
def apo_down_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "apo_down")
    return torch.sigmoid(params.beta * chosen) + 1 - torch.sigmoid(params.beta * (chosen - rejected))


# TRL 1.16 dpo_trainer.py, _compute_loss, "exo_pair" (EXO 2402.00856 eq. 16):
# KL(softmax over {chosen, rejected} of beta * log-ratio || [1 - eps, eps]).
# eps = 0 makes log eps infinite; TRL rejects it in __init__, we reject it here.
@register_loss("exo_pair", "EXO: reverse KL to the label distribution; needs --label_smoothing in (0, 1) (Ji et al. 2024)")
def exo_pair_loss(logps: PairLogps, params: LossParams) -> Tensor:
    eps = params.label_smoothing
    if not 0.0 < eps < 1.0:
        raise ValueError(f"exo_pair needs label_smoothing in (0, 1), got {eps}; the EXO paper suggests 1e-3")
    chosen, rejected = _logratios(logps, "exo_pair")
    z = params.beta * (chosen - rejected)
    win = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
    lose = torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    return win + lose


# TRL 1.16 dpo_trainer.py, _compute_loss, "sigmoid_norm": DPO on per-token
# log-ratios (counts from the unshifted completion_mask, as for ipo).
@register_loss("sigmoid_norm", "DPO's logistic loss on the length-normalised margin")
def sigmoid_norm_loss(logps: PairLogps, params: LossParams) -> Tensor:
    chosen, rejected = _logratios(logps, "sigmoid_norm")
    delta = _per_token(chosen, logps.chosen_tokens) - _per_token(rejected, logps.rejected_tokens)
    return -F.logsigmoid(params.beta * delta)
