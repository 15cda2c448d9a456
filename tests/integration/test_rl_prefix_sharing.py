"""RL `--prefix_sharing`: a prompt and its completions laid out as prompt | completion | ... give the same per-token
log-probs, entropies, critic values and gradients as prompt + completion for every completion.

The critic in float64 must agree to 1e-12: transformers' RMSNorm computes in fp32 whatever the model's dtype,
which leaves float32 rounding (8e-8 relative in the gradients) that differs between the layouts only in summation
order, so these tests make it compute in the model's dtype. The policy's log-probs come from openpack's chunked LM
head, which computes logits in fp32 by design: it is checked in fp32 to 1e-5. The whole runs (fp32, 1e-5, every
loss aggregation, split groups, 2 ranks, the critic) are in test_train_ppo.py and test_ppo_critic.py.
"""

import pytest
import torch

from openpack.core.batch import collate_packed
from openpack.models.attention import register_packed_attention
from openpack.models.packed import PackedCausalLM
from openpack.models.reward import PackedValueModel
from openpack.models.tiny import tiny_causal_lm, tiny_config
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import response_values

N = 4  # completions per prompt


def exact_norm(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(autouse=True)
def norms_in_the_model_dtype(monkeypatch):
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", exact_norm)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", exact_norm)
    register_packed_attention()


def rollouts(vocab: int) -> Rollouts:
    """3 prompts x 4 completions, prompt-major, lengths 3-11 and 1-7."""
    generator = torch.Generator().manual_seed(1)

    def draw(low, high):
        return torch.randint(3, vocab, (int(torch.randint(low, high, (1,), generator=generator)),),
                             generator=generator).tolist()

    prompts = [draw(3, 12) for _ in range(3)]
    completions = [draw(1, 8) for _ in range(3 * N)]
    return Rollouts([p for p in prompts for _ in range(N)], completions, [[0.0] * len(c) for c in completions],
                    [True] * len(completions))


def per_completion_outputs(module, batch_rollouts: Rollouts, shared: bool, max_tokens: int, entropy: bool):
    """Outputs at every completion token (completion order) and each parameter's gradient of their weighted sum,
    over the units of every completion (a scoring pass's layout), one row per unit set."""
    units = Units(batch_rollouts, shared, N, max_tokens)
    ids = units.add(range(len(batch_rollouts.completion_tokens)))
    batch = collate_packed([s for u in ids for s in units.segments(u)])
    module.zero_grad()
    if entropy:
        entropies = torch.zeros(batch.labels.numel())
        values = response_values(batch, module(batch, entropy=entropies))
        extra = response_values(batch, entropies)
    else:
        values, extra = response_values(batch, module(batch)), None
    order = units.completions(ids)
    lengths = batch_rollouts.response_lengths()
    pieces = dict(zip(order, values.split([lengths[k] for k in order])))
    values = torch.cat([pieces[k] for k in range(len(lengths))])  # completion order, whatever the layout
    weights = torch.linspace(-1, 1, values.numel(), dtype=values.dtype)
    (values * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return values.detach(), extra, grads


def assert_equal_layouts(module, vocab: int, entropy: bool, atol: float):
    batch_rollouts = rollouts(vocab)
    plain = per_completion_outputs(module, batch_rollouts, False, 4096, entropy)
    for max_tokens in (4096, 24):  # whole groups; groups split into units with a prompt copy each
        shared = per_completion_outputs(module, batch_rollouts, True, max_tokens, entropy)
        torch.testing.assert_close(shared[0], plain[0], atol=atol, rtol=0)
        if entropy:  # the same multiset of per-token entropies (their order follows the layout)
            torch.testing.assert_close(shared[1].sort().values, plain[1].sort().values, atol=atol, rtol=0)
        for name in plain[2]:
            torch.testing.assert_close(shared[2][name], plain[2][name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_policy_logprobs_entropies_and_gradients_equal_unshared(arch):
    model = tiny_causal_lm(arch)
    assert_equal_layouts(PackedCausalLM(model), model.config.vocab_size, entropy=True, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_critic_values_and_gradients_equal_unshared(arch):
    from transformers import AutoModelForSequenceClassification

    config = tiny_config(arch)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config).double()
    model.config._attn_implementation = tiny_causal_lm(arch).config._attn_implementation
    assert_equal_layouts(PackedValueModel(model), config.vocab_size, entropy=False, atol=1e-12)


def test_a_group_over_the_cap_is_split_and_counted():
    batch_rollouts = rollouts(64)
    units = Units(batch_rollouts, True, N, 24)
    ids = units.add(range(3 * N))
    assert sorted(units.completions(ids)) == list(range(3 * N))  # every completion once
    assert units.split_groups > 0 and len(ids) > 3
    for u in ids:
        assert sum(units.lengths[u]) <= 24 or len(units.members[u]) == 1  # a unit passes the cap only alone
        assert len({k // N for k in units.members[u]}) == 1  # one prompt per unit
