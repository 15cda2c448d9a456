"""GSPO, CISPO, dual clip and the entropy bonus (``core/rl_losses.py``) against numbers derived by hand.

Ratios away from 1 stand for a second update on a rollout batch (the old policy's log-probs from the pass before the
first update); at the first update the old log-probs are the current ones, detached, and every ratio is 1.
"""

import math

import pytest
import torch

from openpack.core.rl_losses import DEFAULT_CLIP, Completions, PolicyLossParams, policy_terms, token_weights


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=tol)


def gspo(eps=DEFAULT_CLIP["gspo"], **more):
    return PolicyLossParams(eps_low=eps[0], eps_high=eps[1], loss_type="gspo", **more)


def test_gspo_one_clipped_ratio_per_completion():
    """Completion 0: log-ratios 2e-4 and 4e-4, mean 3e-4, s_0 = exp(3e-4) inside [1 - 3e-4, 1 + 4e-4]: every token's
    loss is -s_0 A_t and its gradient -s_0 A_t. Completion 1: log-ratios 0 and 2e-3 (a token ratio far outside the
    range), mean 1e-3, s_1 = exp(1e-3) > 1 + 4e-4: with A = +2 the clipped branch, loss -(1 + 4e-4) 2 on both
    tokens and no gradient; with A = -1 the unclipped branch, loss s_1 on both tokens and gradient s_1."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    logp = (old + torch.tensor([2e-4, 4e-4, 0.0, 2e-3], dtype=torch.float64)).requires_grad_()
    segments = torch.tensor([0, 0, 1, 1])
    s0, s1 = math.exp(3e-4), math.exp(1e-3)
    for a1, loss1, grad1, clipped1 in [(2.0, -(1 + 4e-4) * 2.0, 0.0, True), (-1.0, s1, s1, False)]:
        advantages = torch.tensor([1.0, 0.5, a1, a1], dtype=torch.float64)
        terms = policy_terms(logp, old, advantages, gspo(), completions=Completions.of(segments))
        close(terms.loss.detach(), [-s0, -s0 * 0.5, loss1, loss1], tol=1e-12)
        assert terms.clipped.tolist() == [False, False, clipped1, clipped1]
        (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
        close(grad, [-s0, -s0 * 0.5, grad1, grad1], tol=1e-12)


def test_gspo_at_the_first_update_is_the_sequence_mean_weighting_of_the_token_gradient():
    """old = sg[logp]: s_i = 1 for every completion. Summed with seq_mean_token_mean's weights, GSPO's gradient of
    the parameters is -(1/S) sum_i (1/|y_i|) sum_t A_t d logp_t, what PPO's token loss gives with those weights; a
    token-mean weighting gives another gradient (lengths 3 and 1 differ)."""
    torch.manual_seed(0)
    weight = torch.randn(5, 4, requires_grad=True)
    hidden, labels = torch.randn(4, 4), torch.tensor([1, 3, 0, 2])
    segments, advantages = torch.tensor([0, 0, 0, 1]), torch.tensor([1.0, -0.5, 2.0, -1.0])

    def grad_of(params, mode):
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels[:, None])[:, 0]
        terms = policy_terms(logp, logp.detach(), advantages, params, completions=Completions.of(segments))
        (grad,) = torch.autograd.grad((terms.loss * token_weights(Completions.of(segments), mode, 4, 2)).sum(), weight)
        return grad

    logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels[:, None])[:, 0]
    by_hand = -(advantages * torch.tensor([1 / 6, 1 / 6, 1 / 6, 1 / 2]) * logp).sum()
    (expected,) = torch.autograd.grad(by_hand, weight)
    torch.testing.assert_close(grad_of(gspo(), "seq_mean_token_mean"), expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(grad_of(PolicyLossParams(), "seq_mean_token_mean"), expected, rtol=0, atol=1e-7)
    assert (grad_of(gspo(), "token_mean") - expected).abs().max() > 1e-3


def test_gspo_needs_the_completions():
    with pytest.raises(ValueError, match="completions"):
        policy_terms(torch.zeros(2), torch.zeros(2), torch.ones(2), gspo())


def test_gspo_of_a_completion_split_in_parts_totals_the_parts():
    """A completion's tokens held in two parts (a row split over a context group): GSPO's s_i is the exp of the mean
    log-ratio over the whole completion, so each part needs the other's sum and the whole length. Completion 0 has
    log-ratios 1e-4 | 5e-4, 3e-4 (mean 3e-4), completion 1 has 2e-3 (all in the second part). With ``total`` adding
    the other part's sums each part's loss is the whole's (s_0 = exp(3e-4) inside [1 - 3e-4, 1 + 4e-4], A = 1:
    loss -s_0); from a part's own sums (part 1: exp(1e-4 / 3); part 2: exp(8e-4 / 3)) the losses differ."""
    old = torch.zeros(4, dtype=torch.float64)
    logp = torch.tensor([1e-4, 5e-4, 3e-4, 2e-3], dtype=torch.float64)
    ids, advantages = torch.tensor([0, 0, 0, 1]), torch.ones(4, dtype=torch.float64)
    whole = policy_terms(logp, old, advantages, gspo(), completions=Completions.of(ids)).loss
    close(whole[:3], [-math.exp(3e-4)] * 3, tol=1e-12)
    parts = [slice(0, 1), slice(1, 4)]
    lengths = torch.tensor([3, 1])

    def own_sums(part):
        return torch.zeros(2, dtype=torch.float64).index_add_(0, ids[part], logp[part])

    for mine, other in (parts, parts[::-1]):
        totalled = Completions(ids[mine], lengths, total=lambda sums, other=other: sums + own_sums(other))
        close(policy_terms(logp[mine], old[mine], advantages[mine], gspo(), completions=totalled).loss, whole[mine],
              tol=1e-12)
        alone = Completions(ids[mine], lengths)  # no total: the part's own sum over the whole length
        assert (policy_terms(logp[mine], old[mine], advantages[mine], gspo(), completions=alone).loss
                - whole[mine]).abs().max() > 1e-5


def test_cispo_clips_and_detaches_the_weight_and_keeps_every_gradient():
    """Ratios 0.5, 1.2 and 7 under the default bounds (none below, 5 above): weights 0.5, 1.2, 5 (the last
    clipped). loss_t = -w_t A_t logp_t with logp -1, -2, -0.5 and A 1, -1, 2: 0.5, -2.4, 5; the gradient -w_t A_t
    reaches every token, the clipped one too (PPO's clip would drop it)."""
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([0.5, 1.2, 7.0], dtype=torch.float64))
    low, high = DEFAULT_CLIP["cispo"]
    params = PolicyLossParams(eps_low=low, eps_high=high, loss_type="cispo")
    terms = policy_terms(logp, old, torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64), params)
    close(terms.loss.detach(), [0.5, -2.4, 5.0], tol=1e-12)
    assert terms.clipped.tolist() == [False, False, True]
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    close(grad, [-0.5, 1.2, -10.0], tol=1e-12)
    narrow = policy_terms(logp, old, torch.ones(3, dtype=torch.float64),
                          PolicyLossParams(eps_low=0.2, eps_high=0.28, loss_type="cispo"))
    close(narrow.loss.detach(), [0.8 * 1.0, 1.2 * 2.0, 1.28 * 0.5], tol=1e-12)  # weights 0.8, 1.2, 1.28


def test_dual_clip_bounds_only_negative_advantages():
    """PPO (eps 0.2), dual clip 3. Ratio 5, A -1: PPO's loss is 5, bounded at 3 (no gradient). Ratio 2, A -1: 2,
    under the bound. Ratio 5, A +1: the clipped branch, -1.2, untouched."""
    ratios, advantages = torch.tensor([5.0, 2.0, 5.0]), torch.tensor([-1.0, -1.0, 1.0])
    logp = torch.log(ratios).requires_grad_()
    terms = policy_terms(logp, torch.zeros(3), advantages, PolicyLossParams(dual_clip=3.0))
    close(terms.loss.detach(), [3.0, 2.0, -1.2])
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    close(grad, [0.0, 2.0, 0.0])
    close(policy_terms(logp, torch.zeros(3), advantages, PolicyLossParams()).loss.detach(), [5.0, 2.0, -1.2])


def test_the_entropy_bonus_subtracts_coef_times_the_entropy_with_its_gradient():
    entropy = torch.tensor([0.5, 2.0], requires_grad=True)
    terms = policy_terms(torch.zeros(2), torch.zeros(2), torch.ones(2), PolicyLossParams(entropy_coef=0.01),
                         entropy=entropy)
    close(terms.loss.detach(), [-1.005, -1.02])
    (grad,) = torch.autograd.grad(terms.loss.sum(), entropy)
    close(grad, [-0.01, -0.01])
    with pytest.raises(ValueError, match="entropy"):
        policy_terms(torch.zeros(2), torch.zeros(2), torch.ones(2), PolicyLossParams(entropy_coef=0.01))


def corrected(kind, ratios, segments, band=(0.5, 2.0)):
    """policy_terms of PPO at ratio 1 (loss -A, A = 1) with the trainer/sampler ratios ``ratios``."""
    behaviour = -torch.log(torch.tensor(ratios, dtype=torch.float64))
    params = PolicyLossParams(correction=kind, correction_low=band[0], correction_high=band[1])
    zeros = torch.zeros(len(ratios), dtype=torch.float64)
    return policy_terms(zeros, zeros, torch.ones(len(ratios), dtype=torch.float64), params,
                        behaviour_logp=behaviour, completions=Completions.of(torch.tensor(segments)))


def test_rollout_corrections_hand_values():
    """Band [0.5, 2]. Completion 0: ratios 0.25, 1.5, 4 (geometric mean 1.145, inside); completion 1: 4, 4
    (geometric mean 4, outside). PPO's loss at ratio 1 with A = 1 is -1, so the loss is -c_t:

        tis            c = 0.5, 1.5, 2 | 2, 2            truncated: 0.25, 4, 4, 4
        icepop         c = 0, 1.5, 0 | 0, 0              masked: 0.25 and every 4; the 1.5 unchanged
        seq-mask-tis   c = 0.5, 1.5, 2 | 0, 0            completion 1 masked whole, completion 0 truncated
    """
    ratios, segments = [0.25, 1.5, 4.0, 4.0, 4.0], [0, 0, 0, 1, 1]
    tis = corrected("tis", ratios, segments)
    close(tis.loss, [-0.5, -1.5, -2.0, -2.0, -2.0], tol=1e-12)
    assert tis.tis_clipped.tolist() == [True, False, True, True, True] and not tis.masked.any()
    close(tis.is_ratio, ratios, tol=1e-12)
    icepop = corrected("icepop", ratios, segments)
    close(icepop.loss, [0.0, -1.5, 0.0, 0.0, 0.0], tol=1e-12)
    assert icepop.masked.tolist() == [True, False, True, True, True]
    seq = corrected("seq-mask-tis", ratios, segments)
    close(seq.loss, [-0.5, -1.5, -2.0, 0.0, 0.0], tol=1e-12)
    assert seq.masked.tolist() == [False, False, False, True, True]
    assert seq.tis_clipped.tolist() == [True, False, True, False, False]
    assert math.isclose(math.exp((math.log(0.25) + math.log(1.5) + math.log(4.0)) / 3), 1.1447, rel_tol=1e-4)


def test_a_rollout_correction_needs_the_sampler_s_log_probs():
    with pytest.raises(ValueError, match="behaviour policy"):
        policy_terms(torch.zeros(2), torch.zeros(2), torch.ones(2), PolicyLossParams(correction="icepop"))
