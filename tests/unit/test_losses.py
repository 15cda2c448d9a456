"""Preference losses: hand-derived values, gradients, the registry, and TRL 1.16 as an oracle.

Notation as in ``openpack.core.losses``: c = chosen - ref_chosen,
r = rejected - ref_rejected, h = c - r, sp(x) = ln(1 + e^x) = -logsig(-x),
so -logsig(z) = sp(-z) and sp(z) = z + sp(-z).

The non-trivial case ``CASE`` used below, one pair:
    chosen -4, rejected -12, ref_chosen -5, ref_rejected -9, n_c 2, n_r 4
    -> c = 1, r = -3, h = 4; with beta 0.5: beta c = 0.5, beta r = -1.5, beta h = 2.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from openpack.core.losses import (
    LOSS_SUMMARIES,
    PAIR_LOSSES,
    LossParams,
    PairLogps,
    implicit_rewards,
    needs_reference,
    pair_losses,
    register_loss,
)

LN2 = math.log(2)


def sp(x):
    return math.log1p(math.exp(x))


def sig(x):
    return 1 / (1 + math.exp(-x))


def pairs(chosen, rejected, ref_chosen=None, ref_rejected=None, n_c=None, n_r=None):
    t = lambda v: None if v is None else torch.tensor(v, dtype=torch.float32)  # noqa: E731
    n_c = n_c if n_c is not None else [1] * len(chosen)
    n_r = n_r if n_r is not None else [1] * len(chosen)
    return PairLogps(t(chosen), t(rejected), t(ref_chosen), t(ref_rejected), t(n_c), t(n_r))


CASE = pairs([-4.0], [-12.0], [-5.0], [-9.0], [2], [4])


def loss(name, logps, **params):
    return PAIR_LOSSES[name](logps, LossParams(**params))


# --- policy == reference: TRL's step-1 values (ANCHORS.md) ---------------------------------------

STEP1 = {  # beta 0.1, c = r = h = 0
    "sigmoid": LN2,  # -logsig(0) = ln 2
    "hinge": 1.0,  # relu(1 - 0) = 1
    "ipo": 25.0,  # (0 / n_c - 0 / n_r - 1 / 0.2)^2 = 5^2
    "robust": LN2,  # (-(1 - eps) logsig 0 + eps logsig 0) / (1 - 2 eps) = ln 2 (1 - 2 eps) / (1 - 2 eps)
    "sppo_hard": 50.0,  # (0 - 5)^2 + (0 + 5)^2
    "nca_pair": 2 * LN2,  # ln 2 + ln 2 / 2 + ln 2 / 2
    "bco_pair": 2 * LN2,  # ln 2 + ln 2
    "apo_zero": 1.0,  # 1 - 1/2 + 1/2
    "apo_down": 1.0,  # 1/2 + 1 - 1/2
    "sigmoid_norm": LN2,  # -logsig(0)
}


@pytest.mark.parametrize("name", sorted(STEP1))
def test_step1_values_with_policy_equal_to_reference(name):
    """Policy == reference makes every log-ratio 0, so each loss is a constant of beta only (ANCHORS.md).

    Robust gets label_smoothing 0.2 to show the (1 - 2 eps) denominator cancels at h = 0.
    """
    policy_chosen, policy_rejected = [-7.0, -3.0, -20.0], [-9.0, -1.0, -4.0]
    logps = pairs(policy_chosen, policy_rejected, policy_chosen, policy_rejected, [3, 1, 8], [5, 2, 1])
    eps = 0.2 if name == "robust" else 0.0
    torch.testing.assert_close(loss(name, logps, beta=0.1, label_smoothing=eps), torch.full((3,), STEP1[name]))


def test_exo_pair_at_policy_equal_to_reference():
    """q = sigmoid(0) = 1/2: 1/2 (ln 1/2 - ln(1 - eps)) + 1/2 (ln 1/2 - ln eps) = -ln 2 - ln(eps (1 - eps)) / 2."""
    logps = pairs([-2.0], [-3.0], [-2.0], [-3.0])
    expected = -LN2 - 0.5 * math.log(0.1 * 0.9)
    torch.testing.assert_close(loss("exo_pair", logps, label_smoothing=0.1), torch.tensor([expected]))


def test_simpo_and_sft_with_equal_averages():
    """SimPO, chosen avg == rejected avg (-6/3 == -4/2 == -2): z = beta 0 - gamma, loss -logsig(-0.5) = sp(0.5).

    sft: one pair, -(-6) / 3 tokens = 2 nats per token. Neither reads the reference (None).
    """
    logps = pairs([-6.0], [-4.0], None, None, [3], [2])
    torch.testing.assert_close(loss("simpo", logps, simpo_gamma=0.5), torch.tensor([sp(0.5)]))
    torch.testing.assert_close(loss("sft", logps), torch.tensor([2.0]))


# --- non-trivial hand-computed cases ---------------------------------------------------------------


def test_sigmoid_and_cdpo():
    """CASE, beta 0.5, z = beta h = 2.

    eps 0: -logsig(2) = sp(-2).
    eps 0.1 (cDPO): -(0.9) logsig(2) - 0.1 logsig(-2) = 0.9 sp(-2) + 0.1 sp(2) = sp(-2) + 0.1 * 2.
    """
    torch.testing.assert_close(loss("sigmoid", CASE, beta=0.5), torch.tensor([sp(-2)]))
    torch.testing.assert_close(loss("sigmoid", CASE, beta=0.5, label_smoothing=0.1), torch.tensor([sp(-2) + 0.2]))


def test_ipo_is_length_normalised():
    """CASE, beta 0.5: c / n_c = 1/2, r / n_r = -3/4, delta = 5/4, 1 / (2 beta) = 1 -> (1/4)^2 = 1/16.

    Without TRL's per-token normalisation it would be (h - 1)^2 = 9.
    """
    torch.testing.assert_close(loss("ipo", CASE, beta=0.5), torch.tensor([0.0625]))


def test_hinge_puts_beta_inside():
    """CASE: beta 0.1 -> relu(1 - 0.1 * 4) = 0.6 (beta * relu(1 - h) would be 0); beta 0.5 -> relu(1 - 2) = 0."""
    torch.testing.assert_close(loss("hinge", CASE, beta=0.1), torch.tensor([0.6]))
    torch.testing.assert_close(loss("hinge", CASE, beta=0.5), torch.tensor([0.0]))


def test_robust():
    """CASE, beta 0.5, z = 2, eps 0.1.

    -(1 - eps) logsig z + eps logsig(-z) = (1 - eps) sp(-z) - eps sp(z) = (1 - 2 eps) sp(-z) - eps z,
    divided by (1 - 2 eps): sp(-2) - 0.1 * 2 / 0.8 = sp(-2) - 0.25 (negative: rDPO is unbiased, not bounded).
    """
    torch.testing.assert_close(loss("robust", CASE, beta=0.5, label_smoothing=0.1), torch.tensor([sp(-2) - 0.25]))


def test_robust_rejects_half_or_more_label_smoothing():
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        loss("robust", CASE, label_smoothing=0.5)


def test_simpo_uses_average_logprobs_and_margin():
    """CASE policy only: chosen avg -4/2 = -2, rejected avg -12/4 = -3, difference 1.

    beta 2.5, gamma 0.5: z = 2.5 * 1 - 0.5 = 2; eps 0.1 -> sp(-2) + 0.1 * 2 (as cDPO above).
    On sums it would be z = 2.5 * 8 - 0.5 = 19.5. References are not read.
    """
    no_ref = pairs([-4.0], [-12.0], None, None, [2], [4])
    got = loss("simpo", no_ref, beta=2.5, simpo_gamma=0.5, label_smoothing=0.1)
    torch.testing.assert_close(got, torch.tensor([sp(-2) + 0.2]))


def test_sft_is_a_token_mean_over_the_batch():
    """Two pairs, chosen sums -4 (2 tokens) and -9 (1 token).

    TRL: token mean over the batch = 13 / 3. Per pair -chosen / (3 tokens / 2 pairs) = [8/3, 6],
    whose mean is 13/3 (a mean of per-response means would give (2 + 9) / 2 = 5.5).
    With the step's tokens per pair given (2.0): [2, 4.5].
    """
    logps = pairs([-4.0, -9.0], [-1.0, -1.0], None, None, [2, 1], [1, 1])
    got = loss("sft", logps)
    torch.testing.assert_close(got, torch.tensor([8 / 3, 6.0]))
    torch.testing.assert_close(got.mean(), torch.tensor(13 / 3))
    torch.testing.assert_close(loss("sft", logps, sft_tokens_per_pair=2.0), torch.tensor([2.0, 4.5]))


def test_sft_split_over_micro_batches_equals_whole_step():
    """Pairs split 1 + 2 over micro-batches, sft_tokens_per_pair = 6 tokens / 3 pairs: the summed per-pair
    losses / 3 pairs equal the token mean 12 / 6 = 2 of the whole step."""
    a = pairs([-3.0], [-1.0], None, None, [1], [1])
    b = pairs([-4.0, -5.0], [-1.0, -1.0], None, None, [2, 3], [1, 1])
    total = sum(loss("sft", x, sft_tokens_per_pair=2.0).sum() for x in (a, b)) / 3
    torch.testing.assert_close(total, torch.tensor(2.0))


EXTRAS = {  # CASE, beta 0.5: beta c = 0.5, beta r = -1.5, beta h = 2
    "nca_pair": sp(-0.5) + 0.5 * sp(0.5) + 0.5 * sp(-1.5),  # -logsig(.5) - logsig(-.5)/2 - logsig(1.5)/2
    "bco_pair": sp(-0.5) + sp(-1.5),  # -logsig(.5) - logsig(1.5)
    "sppo_hard": 4.0,  # target 1 / (2 beta) = 1: (1 - 1)^2 + (-3 + 1)^2
    "apo_zero": 1 - sig(0.5) + sig(-1.5),
    "apo_down": sig(0.5) + 1 - sig(2.0),
    "sigmoid_norm": sp(-0.625),  # beta (1/2 + 3/4) = 0.625
}


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_extra_losses(name):
    """Each value is the loss's formula (module docstring) evaluated by hand on CASE, beta 0.5."""
    torch.testing.assert_close(loss(name, CASE, beta=0.5), torch.tensor([EXTRAS[name]]))


def test_exo_pair():
    """CASE, beta 0.5, z = 2, eps 0.1: q = sig(2); q (ln q - ln 0.9) + (1 - q) (ln(1 - q) - ln 0.1)."""
    q = sig(2.0)
    expected = q * (math.log(q) - math.log(0.9)) + (1 - q) * (math.log(1 - q) - math.log(0.1))
    torch.testing.assert_close(loss("exo_pair", CASE, beta=0.5, label_smoothing=0.1), torch.tensor([expected]))
    with pytest.raises(ValueError, match="exo_pair"):
        loss("exo_pair", CASE)


# --- gradients --------------------------------------------------------------------------------------


def random_pairs(num_pairs, scale, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    values = [(-scale * torch.rand(num_pairs, generator=g)).requires_grad_(requires_grad) for _ in range(4)]
    tokens = [torch.randint(1, 50, (num_pairs,), generator=g).float() for _ in range(2)]
    return PairLogps(*values, *tokens)


def params_for(name):
    return LossParams(beta=0.1, label_smoothing=0.1 if name in ("exo_pair", "robust", "sigmoid", "simpo") else 0.0)


@pytest.mark.parametrize("scale", [1.0, 2000.0])
@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_gradients_are_finite(name, scale):
    """Small and huge log-prob sums (|beta h| up to ~200): loss and gradients stay finite."""
    logps = random_pairs(6, scale)
    out = PAIR_LOSSES[name](logps, params_for(name))
    assert out.shape == (6,) and torch.isfinite(out).all()
    grads = torch.autograd.grad(out.sum(), [logps.chosen, logps.rejected], allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    if scale == 1.0:  # at 2000 saturated sigmoids may give exact zeros in fp32
        assert grads[0].abs().sum() > 0


def test_sigmoid_gradient_at_policy_equal_to_reference():
    """d/d chosen of -logsig(beta h) = -beta sigmoid(-beta h) = -beta / 2 at h = 0; +beta / 2 for rejected."""
    logps = random_pairs(3, 5.0)
    logps.ref_chosen, logps.ref_rejected = logps.chosen.detach(), logps.rejected.detach()
    g_c, g_r = torch.autograd.grad(loss("sigmoid", logps, beta=0.1).sum(), [logps.chosen, logps.rejected])
    torch.testing.assert_close(g_c, torch.full((3,), -0.05))
    torch.testing.assert_close(g_r, torch.full((3,), 0.05))


# --- registry ---------------------------------------------------------------------------------------


def test_pair_losses_is_the_weighted_sum():
    logps = random_pairs(5, 30.0, requires_grad=False)
    params = LossParams(beta=0.2, label_smoothing=0.1)
    got = pair_losses(logps, params, ["sigmoid", "sft", "ipo"], [0.8, 0.2, 1.5])
    expected = 0.8 * loss("sigmoid", logps, beta=0.2, label_smoothing=0.1)
    expected = expected + 0.2 * loss("sft", logps, beta=0.2) + 1.5 * loss("ipo", logps, beta=0.2)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(pair_losses(logps, params, ["hinge"]), loss("hinge", logps, beta=0.2))


def test_pair_losses_errors():
    with pytest.raises(ValueError, match=r"unknown loss type 'dpo'.*hinge.*sigmoid.*simpo"):
        pair_losses(CASE, LossParams(), ["sigmoid", "dpo"])
    with pytest.raises(ValueError, match="2 loss weights for 1 loss types"):
        pair_losses(CASE, LossParams(), ["sigmoid"], [1.0, 2.0])
    with pytest.raises(ValueError, match="empty"):
        pair_losses(CASE, LossParams(), [])


def test_missing_reference_is_an_actionable_error():
    no_ref = pairs([-1.0], [-2.0])
    with pytest.raises(ValueError, match="ipo needs reference log-probs.*simpo, sft"):
        pair_losses(no_ref, LossParams(), ["ipo"])


def test_needs_reference():
    assert not needs_reference(["simpo"]) and not needs_reference(["simpo", "sft"]) and not needs_reference(["sft"])
    assert needs_reference(["sigmoid"]) and needs_reference(["simpo", "ipo"]) and needs_reference(["sft", "sigmoid"])
    with pytest.raises(ValueError, match="unknown loss type"):
        needs_reference(["nope"])


def test_implicit_rewards():
    """CASE, beta 0.5: 0.5 * 1 and 0.5 * -3, detached (metrics only).

    Without a reference the reference counts as 0 (TRL's CPO): 0.5 * -4 and 0.5 * -12.
    """
    logps = pairs([-4.0], [-12.0], [-5.0], [-9.0])
    logps.chosen.requires_grad_(True)
    chosen, rejected = implicit_rewards(logps, 0.5)
    torch.testing.assert_close(chosen, torch.tensor([0.5]))
    torch.testing.assert_close(rejected, torch.tensor([-1.5]))
    assert not chosen.requires_grad
    chosen, rejected = implicit_rewards(pairs([-4.0], [-12.0]), 0.5)
    torch.testing.assert_close((chosen, rejected), (torch.tensor([-2.0]), torch.tensor([-6.0])))


def test_register_loss_adds_and_refuses_duplicates():
    @register_loss("_test_zero", "always zero", reference_free=True)
    def zero(logps, params):
        return torch.zeros_like(logps.chosen)

    try:
        assert PAIR_LOSSES["_test_zero"] is zero and not needs_reference(["_test_zero"])
        with pytest.raises(ValueError, match="already registered"):
            register_loss("sigmoid", "again")(zero)
    finally:
        PAIR_LOSSES.pop("_test_zero")
        LOSS_SUMMARIES.pop("_test_zero")


# --- TRL 1.16 as the oracle --------------------------------------------------------------------------
# TRL computes DPO losses inline in DPOTrainer._compute_loss (no standalone function), so we call the
# unbound method on a stub holding the attributes it reads and a stub model that returns our per-token
# log-probs; the reference log-probs go in as precomputed ones. SimPO and cDPO come from
# CPOTrainer.cpo_loss, which takes log-prob tensors directly. Importing TRL takes ~10 s: marked slow.

TRL_DPO_LOSSES = ["sigmoid", "ipo", "hinge", "robust", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down"]
TRL_DPO_LOSSES += ["exo_pair", "sigmoid_norm"]


@pytest.fixture(scope="module")
def trl_trainers():
    pytest.importorskip("trl")
    import os
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.cpo.cpo_trainer import CPOTrainer
        from trl.trainer.dpo_trainer import DPOTrainer
    return DPOTrainer, CPOTrainer


def trl_padded_batch(num_pairs, seed):
    """A TRL-shaped batch: rows [chosen..., rejected...], prompt of 3 tokens then 1..6 completion tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt, longest = 3, 9
    lengths = torch.randint(1, 7, (2 * num_pairs,), generator=g)
    positions = torch.arange(longest)
    completion_mask = ((positions >= prompt) & (positions < prompt + lengths[:, None])).long()
    shift_mask = completion_mask[:, 1:]
    policy = -3 * torch.rand(2 * num_pairs, longest - 1, generator=g, dtype=torch.float64).float() * shift_mask
    ref = -3 * torch.rand(2 * num_pairs, longest - 1, generator=g, dtype=torch.float64).float() * shift_mask
    return completion_mask, policy, ref.sum(1)


class StubModel:
    """Stands in for the policy: TRL's fused-LM-head output with our per-token log-probs (0 off the completion)."""

    training = True

    def __init__(self, log_probs):
        self.log_probs = log_probs

    def __call__(self, **kwargs):
        zeros = torch.zeros_like(self.log_probs)
        return SimpleNamespace(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def trl_dpo(DPOTrainer, completion_mask, policy_token_logps, ref_logps, loss_types, weights, beta, eps):
    model = StubModel(policy_token_logps)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    stub = SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None,
        f_divergence_type="reverse_kl", loss_types=loss_types, loss_weights=weights, beta=beta,
        label_smoothing=eps, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(discopop_tau=0.05),
    )
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    inputs = {
        "input_ids": torch.ones_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected,
    }
    return DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)


def ours_from(completion_mask, policy_token_logps, ref_logps):
    chosen, rejected = policy_token_logps.sum(1).chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    n_chosen, n_rejected = completion_mask[:, 1:].sum(1).float().chunk(2)
    return PairLogps(chosen, rejected, ref_chosen, ref_rejected, n_chosen, n_rejected)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRL_DPO_LOSSES)
def test_matches_trl_dpo_per_pair(trl_trainers, name):
    """Each pair alone through TRL's DPOTrainer._compute_loss equals our per-pair loss, to 1e-6."""
    DPOTrainer, _ = trl_trainers
    eps = {"robust": 0.2, "exo_pair": 0.1}.get(name, 0.0)
    mask, policy, ref = trl_padded_batch(6, seed=1)
    ours = PAIR_LOSSES[name](ours_from(mask, policy, ref), LossParams(beta=0.3, label_smoothing=eps))
    for i in range(6):
        rows = [i, 6 + i]
        theirs = trl_dpo(DPOTrainer, mask[rows], policy[rows], ref[rows], [name], [1.0], 0.3, eps)
        torch.testing.assert_close(ours[i], theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_matches_trl_dpo_batch_mean_with_weights_and_sft(trl_trainers):
    """A 6-pair batch with TRL's loss_type list and loss_weights, sft included: TRL's scalar equals the
    mean over pairs of our pair_losses (sft matches only as that mean, by construction)."""
    DPOTrainer, _ = trl_trainers
    mask, policy, ref = trl_padded_batch(6, seed=2)
    names, weights = ["sigmoid", "sft", "ipo", "bco_pair"], [0.8, 0.2, 0.5, 1.0]
    theirs = trl_dpo(DPOTrainer, mask, policy, ref, names, weights, 0.1, 0.0)
    ours = pair_losses(ours_from(mask, policy, ref), LossParams(beta=0.1), names, weights).mean()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    sft_theirs = trl_dpo(DPOTrainer, mask, policy, ref, ["sft"], [1.0], 0.1, 0.0)
    torch.testing.assert_close(loss("sft", ours_from(mask, policy, ref)).mean(), sft_theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_matches_trl_cpo_simpo_and_cdpo(trl_trainers, eps):
    """SimPO: CPOTrainer.cpo_loss("simpo") on average log-probs. cDPO: CPO's "sigmoid" on the log-ratios
    c and r gives -(1 - eps) logsig(beta h) - eps logsig(-beta h), our sigmoid with label smoothing."""
    _, CPOTrainer = trl_trainers
    mask, policy, ref = trl_padded_batch(8, seed=3)
    logps = ours_from(mask, policy, ref)

    def cpo(loss_type, chosen, rejected, beta):
        stub = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=eps, loss_type=loss_type, simpo_gamma=0.7,
                               accelerator=SimpleNamespace(device=torch.device("cpu")))
        return CPOTrainer.cpo_loss(stub, chosen, rejected)[0]

    simpo_theirs = cpo("simpo", logps.chosen / logps.chosen_tokens, logps.rejected / logps.rejected_tokens, 2.0)
    simpo_ours = loss("simpo", logps, beta=2.0, simpo_gamma=0.7, label_smoothing=eps)
    torch.testing.assert_close(simpo_ours, simpo_theirs, atol=1e-6, rtol=1e-6)
    cdpo_theirs = cpo("sigmoid", logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected, 0.3)
    cdpo_ours = loss("sigmoid", logps, beta=0.3, label_smoothing=eps)
    torch.testing.assert_close(cdpo_ours, cdpo_theirs, atol=1e-6, rtol=1e-6)
