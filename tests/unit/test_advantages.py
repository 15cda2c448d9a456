"""Advantage estimators, KL estimators, token returns and the clipped policy loss against hand-derived values.

Rewards [1, 0, 0, 1 | 2, 2, 2, 2] in groups of n = 4. Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) =
0.57735, so GRPO gives +-0.5 / 0.57735 = +-0.86603; group 2 is constant: 0 (not 0/0). Dr. GRPO: +-0.5.
RLOO: 1 - (0 + 0 + 1) / 3 = 0.66667 = 4/3 * 0.5.
KL at d = logp - ref_logp = 0.5: k1 0.5, k2 0.125, k3 e^-0.5 - 1 + 0.5 = 0.10653.
Returns, completions [t0 t1 t2 | t3 t4], scalars [1, -2], penalties [.1 .2 .3 | .4 .5], gamma 1:
t0 .1+.2+.3+1 = 1.6, t1 1.5, t2 1.3, t3 .4+.5-2 = -1.1, t4 -1.5; gamma 0.5: t2 1.3, t1 .2 + .65 = .85,
t0 .1 + .425 = .525.
PPO at ratio 1.5, eps 0.2: A = 1 -> -min(1.5, 1.2) = -1.2 (clipped); A = -1 -> -min(-1.5, -1.2) = 1.5 (not).
"""

import math

import pytest
import torch

from openpack.core.advantages import kl, sequence_advantages, token_returns, whiten, whitens
from openpack.core.rl_losses import PolicyLossParams, policy_terms, token_weights

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def test_group_estimators_hand_values():
    g = 0.5 / math.sqrt(1 / 3)
    close(sequence_advantages(REWARDS, 4, "group_norm"), [g, -g, -g, g, 0, 0, 0, 0])
    close(sequence_advantages(REWARDS, 4, "dr_grpo"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    close(sequence_advantages(REWARDS, 4, "rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    close(sequence_advantages(REWARDS, 4, "reinforce_baseline"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    close(sequence_advantages(REWARDS, 4, "reinforce"), REWARDS.tolist())
    assert [whitens(e) for e in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")] == [
        False, False, False, True, True]


def test_estimator_errors():
    with pytest.raises(ValueError, match="do not split into groups of n_samples_per_prompt 3"):
        sequence_advantages(REWARDS, 3, "group_norm")
    with pytest.raises(ValueError, match="rloo needs n_samples_per_prompt >= 2"):
        sequence_advantages(REWARDS, 1, "rloo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        sequence_advantages(REWARDS, 4, "gae")


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-0.5, -1.0])
    close(kl(logp, ref, "k1"), [0.5, 0.0])
    close(kl(logp, ref, "k2"), [0.125, 0.0])
    close(kl(logp, ref, "k3"), [math.exp(-0.5) - 0.5, 0.0])
    assert (kl(torch.randn(100), torch.randn(100), "k3") >= 0).all()  # k3 is never negative


def test_token_returns_hand_values():
    segments, scalars = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1.0, -2.0])
    penalty = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    close(token_returns(scalars, segments, penalty), [1.6, 1.5, 1.3, -1.1, -1.5])
    close(token_returns(scalars, segments, penalty, gamma=0.5)[:3], [0.525, 0.85, 1.3])
    close(token_returns(scalars, segments), [1, 1, 1, -2, -2])  # no penalty: the scalar on every token


def test_whitening_with_the_whole_batch_statistics():
    close(whiten(torch.tensor([1.0, 2.0, 3.0])), [-1, 0, 1])
    values = torch.tensor([1.0, 5.0, 2.0, 7.0, 3.0])
    total, total_sq = values.sum().item(), values.square().sum().item()
    parts = [whiten(part, total, total_sq, 5) for part in (values[:2], values[2:])]  # two ranks' shares
    torch.testing.assert_close(torch.cat(parts), whiten(values))


def test_clipped_policy_loss_hand_values():
    logp, old = torch.log(torch.tensor([1.5, 1.5, 1.0])), torch.zeros(3)
    terms = policy_terms(logp, old, torch.tensor([1.0, -1.0, 2.0]), PolicyLossParams(eps_low=0.2, eps_high=0.2))
    close(terms.loss, [-1.2, 1.5, -2.0])
    assert terms.clipped.tolist() == [True, False, False]
    high = policy_terms(logp, old, torch.tensor([1.0, -1.0, 2.0]), PolicyLossParams(eps_low=0.2, eps_high=0.28))
    close(high.loss, [-1.28, 1.5, -2.0])  # DAPO's clip-higher widens only the upper side


def test_truncated_importance_sampling_and_kl_loss():
    """Behaviour (vLLM) log-prob log(1/3) below the old one: weight 3, capped at 2; kl_coef 0.1 adds 0.1 k3."""
    old, logp = torch.zeros(2), torch.zeros(2)
    behaviour = torch.log(torch.tensor([1 / 3, 1.0]))
    params = PolicyLossParams(tis_cap=2.0, kl_coef=0.1, kl_estimator="k3")
    ref = torch.tensor([-0.5, 0.0])
    terms = policy_terms(logp, old, torch.tensor([1.0, 1.0]), params, ref_logp=ref, behaviour_logp=behaviour)
    close(terms.loss, [-2.0 + 0.1 * (math.exp(-0.5) - 0.5), -1.0])
    assert terms.tis_clipped.tolist() == [True, False]
    with pytest.raises(ValueError, match="behaviour policy"):
        policy_terms(logp, old, torch.ones(2), PolicyLossParams(tis_cap=2.0))


def test_token_weights_sum_to_the_step_mean_however_the_step_is_split():
    segments = torch.tensor([0, 0, 0, 1, 1])
    close(token_weights(segments, "token_mean", 5, 2), [0.2] * 5)
    close(token_weights(segments, "seq_mean_token_mean", 5, 2), [1 / 6] * 3 + [1 / 4] * 2)
    close(token_weights(segments, "seq_mean_token_sum_norm", 5, 2, generate_max_len=10), [0.05] * 5)
    # two micro-batches (one completion each), weights from the step's counts: the same weights as one batch
    split = torch.cat([token_weights(torch.zeros(3, dtype=torch.long), "seq_mean_token_mean", 5, 2),
                       token_weights(torch.zeros(2, dtype=torch.long), "seq_mean_token_mean", 5, 2)])
    torch.testing.assert_close(split, token_weights(segments, "seq_mean_token_mean", 5, 2))
    with pytest.raises(ValueError, match="divides by generate_max_len"):
        token_weights(segments, "seq_mean_token_sum_norm", 5, 2)
