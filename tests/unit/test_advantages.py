"""Advantage estimators, GAE, KL estimators and controllers, reward shaping and the policy and value losses against
hand-derived values.

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

from openpack.core.advantages import (AdaptiveKLController, FixedKLController, clip_rewards, gae, keep_groups, kl,
                                      kl_controller, overlong_penalty, sequence_advantages, stop_properly_penalty,
                                      token_returns, token_rewards, whiten, whitens)
from openpack.core.rl_losses import PolicyLossParams, policy_terms, token_weights, value_terms

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
    params = PolicyLossParams(correction="tis", correction_high=2.0, kl_coef=0.1, kl_estimator="k3")
    ref = torch.tensor([-0.5, 0.0])
    terms = policy_terms(logp, old, torch.tensor([1.0, 1.0]), params, ref_logp=ref, behaviour_logp=behaviour)
    close(terms.loss, [-2.0 + 0.1 * (math.exp(-0.5) - 0.5), -1.0])
    assert terms.tis_clipped.tolist() == [True, False]
    with pytest.raises(ValueError, match="behaviour policy"):
        policy_terms(logp, old, torch.ones(2), PolicyLossParams(correction="tis", correction_high=2.0))


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


SEGMENTS = torch.tensor([0, 0, 1, 1, 1])  # two completions, of 2 and 3 response tokens


def test_token_rewards_put_the_scalar_on_each_completions_last_token():
    """Penalties [.1 .2 .3 | .4 .5], scalars [1, -2]: [.1, .2, .3 + 1, .4, .5 - 2] = [.1, .2, 1.3, .4, -1.5]."""
    segments, penalty = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    rewards = token_rewards(torch.tensor([1.0, -2.0]), segments, penalty)
    assert rewards.dtype == torch.float64
    close(rewards, [0.1, 0.2, 1.3, 0.4, -1.5])
    close(token_rewards(torch.tensor([1.0, -2.0]), segments), [0, 0, 1, 0, -2])
    with pytest.raises(ValueError, match="3 completions' scalars for 2 completions"):
        token_rewards(torch.ones(3), segments)


def test_gae_hand_values():
    """Completions [t0 t1 | t2 t3 t4], rewards [0 1 | 0 0 2], values [.5 .4 | 1 .5 .2], gamma .9, lambd .8
    (gamma lambd = .72); V = 0 after a completion's last token.
    First:  delta1 = 1 - .4 = .6;              A1 = .6;                    R1 = .6 + .4 = 1
            delta0 = 0 + .9 .4 - .5 = -.14;    A0 = -.14 + .72 .6 = .292;  R0 = .792
    Second: delta4 = 2 - .2 = 1.8;             A4 = 1.8;                   R4 = 2
            delta3 = .9 .2 - .5 = -.32;        A3 = -.32 + .72 1.8 = .976; R3 = 1.476
            delta2 = .9 .5 - 1 = -.55;         A2 = -.55 + .72 .976 = .15272; R2 = 1.15272
    lambd 0: A = delta (one-step TD) = [-.14, .6, -.55, -.32, 1.8].
    """
    rewards, values = torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0]), torch.tensor([0.5, 0.4, 1.0, 0.5, 0.2])
    advantages, returns = gae(rewards, values, SEGMENTS, gamma=0.9, lambd=0.8)
    assert advantages.dtype == returns.dtype == torch.float32
    close(advantages, [0.292, 0.6, 0.15272, 0.976, 1.8])
    close(returns, [0.792, 1.0, 1.15272, 1.476, 2.0])
    td, _ = gae(rewards, values, SEGMENTS, gamma=0.9, lambd=0.0)
    close(td, [-0.14, 0.6, -0.55, -0.32, 1.8])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_with_lambda_one_is_the_return_minus_the_value(gamma):
    """lambd = 1 telescopes: A_t = sum_k gamma^k r_{t+k} - V_t, so advantages = token_returns - values and the
    critic's target is token_returns itself, whatever the values."""
    scalars, penalty = torch.tensor([1.0, -2.0]), torch.tensor([0.1, -0.2, 0.3, 0.4, -0.5])
    values = torch.tensor([0.7, -1.3, 2.0, 0.25, -0.6])
    rewards = token_rewards(scalars, SEGMENTS, penalty)
    advantages, returns = gae(rewards, values, SEGMENTS, gamma=gamma, lambd=1.0)
    expected = token_returns(scalars, SEGMENTS, penalty, gamma=gamma)
    torch.testing.assert_close(advantages, expected - values)
    torch.testing.assert_close(returns, expected)


def test_adaptive_kl_controller_hand_values_and_state_round_trip():
    """init .1, target .05, horizon 100:
    kl .06, 10 steps:  .06 / .05 - 1 = .2          -> x (1 + .2 10 / 100) = 1.02 -> .102
    kl .5, 10 steps:   9, clipped to .2            -> x 1.02                   -> .10404
    kl 0, 50 steps:    -1, clipped to -.2          -> x (1 - .2 50 / 100) = .9 -> .093636
    kl .045, 100 steps: -.1                        -> x .9                     -> .0842724
    """
    controller = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    for current_kl, n_steps, expected in [(0.06, 10, 0.102), (0.5, 10, 0.10404), (0.0, 50, 0.093636),
                                          (0.045, 100, 0.0842724)]:
        controller.update(current_kl, n_steps)
        assert controller.value == pytest.approx(expected, rel=1e-12)
    restored = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    restored.update(0.06, 10), controller.update(0.06, 10)
    assert restored.value == controller.value == pytest.approx(0.0842724 * 1.02, rel=1e-12)


def test_fixed_kl_controller_and_the_choice_between_them():
    fixed = kl_controller(0.1, target_kl=None, horizon=100)
    assert isinstance(fixed, FixedKLController)
    fixed.update(10.0, 1000)
    fixed.load_state_dict({"value": 0.5})  # the coefficient is the user's flag
    assert fixed.value == 0.1 and fixed.state_dict() == {"value": 0.1}
    assert isinstance(kl_controller(0.1, target_kl=0.05, horizon=100), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl > 0 and kl_horizon >= 1"):
        kl_controller(0.1, target_kl=0.0, horizon=100)


def test_overlong_penalty_below_inside_and_beyond_the_buffer():
    """generate_max_len 20, buffer 4: expected 16. Lengths 10, 16 -> 0; 17, 18 -> -1/4, -2/4; 20 -> -1 (= -factor);
    25 -> the excess 9 is capped at the buffer: -1. Factor .5 halves each."""
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = overlong_penalty(lengths, generate_max_len=20, buffer_len=4, factor=1.0)
    assert penalty.dtype == torch.float32
    close(penalty, [0, 0, -0.25, -0.5, -1, -1])
    close(overlong_penalty(lengths, 20, 4, 0.5), [0, 0, -0.125, -0.25, -0.5, -0.5])
    for buffer_len in (20, 0):
        with pytest.raises(ValueError, match="must be at least 1 and shorter than generate_max_len"):
            overlong_penalty(lengths, 20, buffer_len, 1.0)


def test_stop_properly_penalty_scales_or_replaces_the_truncated_rewards():
    """ProRL (OpenRLHF 0.11's --reward.stop_properly_penalty_coef): responses 2 and 3 were cut at their budget.
    coef 0.5 halves their rewards (0.5 -> 0.25, -2 -> -1), 0 zeroes them, -0.5 replaces them; 1 leaves all."""
    rewards, truncated = torch.tensor([1.0, 0.5, -2.0, 3.0]), torch.tensor([False, True, True, False])
    close(stop_properly_penalty(rewards, truncated, 0.5), [1, 0.25, -1, 3])
    close(stop_properly_penalty(rewards, truncated, 0.0), [1, 0, 0, 3])
    close(stop_properly_penalty(rewards, truncated, -0.5), [1, -0.5, -0.5, 3])
    close(stop_properly_penalty(rewards, truncated, 1.0), [1, 0.5, -2, 3])
    with pytest.raises(ValueError, match="scales a reward by"):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_clip_rewards():
    rewards = torch.tensor([-3.0, 0.5, 2.0])
    close(clip_rewards(rewards, (-1.0, 1.0)), [-1, 0.5, 1])
    assert clip_rewards(rewards, None) is rewards


def test_keep_groups_drops_all_equal_groups_and_means_outside_the_range():
    """Groups of 3: [1 1 1] equal, [0 1 0] mean 1/3, [0 0 0] equal, [1 0 1] mean 2/3. Range (0, 1) keeps the same
    two (0/1 rewards: an all-equal group has mean 0 or 1); (.5, 1) only the last. [.5 .5] has mean .5 inside (0, 1)
    but all equal: dropped."""
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1])
    assert keep_groups(rewards, 3).tolist() == [False, True, False, True]
    assert keep_groups(rewards, 3, (0.0, 1.0)).tolist() == [False, True, False, True]
    assert keep_groups(rewards, 3, (0.5, 1.0)).tolist() == [False, False, False, True]
    assert keep_groups(torch.tensor([0.5, 0.5, 0.2, 0.8]), 2, (0.0, 1.0)).tolist() == [False, True]
    with pytest.raises(ValueError, match="do not split into groups of n_samples_per_prompt 5"):
        keep_groups(rewards, 5)
    with pytest.raises(ValueError, match="needs n_samples_per_prompt >= 2"):
        keep_groups(rewards, 1)


def test_value_loss_clipped_and_unclipped_hand_values():
    """value_clip .2. t0: v 1, old .5, R 1: v_clipped = .7, max((.7 - 1)^2, 0) = .09 -> .045, the clipped branch
    (no gradient: v - old is beyond the clip). t1: v 1, old .5, R 0: max(.7^2, 1^2) = 1 -> .5, unclipped, gradient
    v - R = 1. t2: v .6, old .5, R 2: inside the clip, both (-1.4)^2 = 1.96 -> .98, gradient v - R = -1.4.
    No clip: .5 (v - R)^2 = [0, .5, .98]."""
    values = torch.tensor([1.0, 1.0, 0.6], requires_grad=True)
    old, returns = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 0.0, 2.0])
    terms = value_terms(values, old, returns, value_clip=0.2)
    close(terms.loss.detach(), [0.045, 0.5, 0.98])
    assert terms.clipped.tolist() == [True, False, False]
    terms.loss.sum().backward()
    close(values.grad, [0.0, 1.0, -1.4])
    for value_clip in (None, 0.0):
        plain = value_terms(values, old, returns, value_clip)
        close(plain.loss.detach(), [0.0, 0.5, 0.98])
        assert plain.clipped.tolist() == [False, False, False]
