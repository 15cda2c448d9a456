"""One update per rollout batch needs no old-policy pass, also under ``--async_train`` (``RLSettings.needs_old_pass``).

The ratio's denominator is the policy before the update, and with one update per batch the update's own forward
runs that very policy: its detached log-probs are what a scoring pass would return. Here a scoring pass in another
layout (each completion's own row, no gradient) and the training forward's detached log-probs give the same clipped
PPO loss with TIS on stale behaviour log-probs, and the same gradients, to fp32 rounding; and the settings skip the
pass exactly when the update count is 1 and no KL goes into the reward, whatever the staleness.
"""

import torch

from openpack.core.batch import collate_packed
from openpack.core.rl_losses import PolicyLossParams, policy_terms
from openpack.models.attention import register_packed_attention
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import response_values
from openpack.rl.settings import RLSettings


def test_the_training_forward_gives_the_old_pass_log_probs_and_so_the_same_loss_and_gradients():
    register_packed_attention()
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    module = PackedCausalLM(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(3)]
    completions = [torch.randint(3, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(12)]
    rollouts = Rollouts([p for p in prompts for _ in range(4)], completions, [[0.0] * len(c) for c in completions],
                        [True] * 12)
    units = Units(rollouts, False, 4, 4096)
    ids = units.add(range(12))
    whole = collate_packed([s for u in ids for s in units.segments(u)])  # the update's row
    with torch.no_grad():  # the old-policy pass: each completion its own row
        scored = torch.cat([response_values(b, module(b)) for b in
                            (collate_packed(list(units.segments(u))) for u in ids)])
    tokens = scored.numel()
    advantages = torch.randn(tokens, generator=g)
    behaviour = scored + 0.3 * torch.randn(tokens, generator=g)  # one version older, as async samples it
    params = PolicyLossParams(eps_low=0.2, eps_high=0.28, correction="tis", correction_high=2.0)

    def loss_and_grads(old_from_pass: bool):
        module.zero_grad(set_to_none=True)
        logp = response_values(whole, module(whole))
        old = scored if old_from_pass else logp.detach()
        terms = policy_terms(logp, old, advantages, params, behaviour_logp=behaviour)
        loss = terms.loss.mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}

    with_pass, without = loss_and_grads(True), loss_and_grads(False)
    assert (scored - response_values(whole, module(whole)).detach()).abs().max() < 1e-5
    torch.testing.assert_close(without[0], with_pass[0], rtol=0, atol=1e-6)
    for name, grad in with_pass[1].items():
        torch.testing.assert_close(without[1][name], grad, rtol=0, atol=1e-6, msg=name)


def test_the_old_pass_runs_only_where_an_update_has_moved_the_policy_or_the_reward_needs_it():
    def settings(updates, staleness, reward_kl=False):
        return RLSettings(4, "group_norm", "token_mean", 16, PolicyLossParams(), kl_coef=0.01 if reward_kl else 0.0,
                          use_kl_loss=False, updates_per_rollout=updates, async_staleness=staleness)

    assert not settings(1, 0).needs_old_pass
    assert not settings(1, 1).needs_old_pass  # async, one update per batch: the update's forward is the old pass
    assert settings(4, 0).needs_old_pass and settings(4, 1).needs_old_pass
    assert settings(1, 1, reward_kl=True).needs_old_pass
