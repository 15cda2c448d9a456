"""The MoE router's load-balancing loss under packing: transformers' number, over real tokens, in every trainer.

Oracle: transformers' own ``load_balancing_loss_func`` (the ``aux_loss`` of ``Qwen3MoeForCausalLM`` /
``MixtralForCausalLM`` called with ``output_router_logits=True``) on the padded batch of the same sequences with
its attention mask. A packed row has no padding, so its aux loss is over every token of the row and must equal it.
A step weights each micro-batch's aux loss by its share of the step's real tokens (``trainers/router_aux.py``).
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from openpack.core.batch import CHOSEN, REJECTED, Segment, collate_packed, collate_padded
from openpack.core.losses import LossParams
from openpack.core.router_loss import load_balancing_loss
from openpack.core.schedule import RankStep
from openpack.distributed.process import DistInfo
from openpack.models.attention import register_packed_attention
from openpack.models.packed import PackedCausalLM, packed_forward
from openpack.models.tiny import tiny_causal_lm
from openpack.models.verify import random_segments
from openpack.core.rl_losses import PolicyLossParams
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import Experience
from openpack.rl.settings import RLSettings
from openpack.rl.update import critic_step, policy_step
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.dpo import PreferenceObjective, dpo_step
from openpack.trainers.reference import ModelReference
from openpack.trainers.sft import train_step

COEF = 0.5  # large, so the aux term's share of a router weight's gradient is far above fp32 rounding
MOE = {
    "qwen3_moe": dict(head_dim=16, num_experts=4, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4),
}
LENGTHS = [5, 9, 3, 17, 11, 6]
MICRO_BATCHES = [[0, 1], [2], [3, 4, 5]]  # 14, 3 and 34 real tokens
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_moe(arch: str, coef: float = COEF, seed: int = 0, **overrides):
    config = AutoConfig.for_model(
        arch, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, router_aux_loss_coef=coef, max_position_embeddings=4096,
        **MOE[arch], **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_packed_attention()).eval()


def transformers_aux(model, segments) -> torch.Tensor:
    """transformers' aux loss of the segments as padded rows, with their attention mask."""
    padded = collate_padded(segments)
    return model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, output_router_logits=True).aux_loss


def decoder_kwargs(model) -> list[dict]:
    """Every call's keyword arguments to ``model``'s decoder, from now on."""
    calls = []
    model.get_decoder().register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    return calls


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(top_k, masked):
    """Value and gradient of ``core.router_loss`` == transformers' function: 3 layers, [2, 7] rows, 8 experts."""
    g = torch.Generator().manual_seed(top_k)
    logits = [torch.randn(14, 8, generator=g, requires_grad=True) for _ in range(3)]
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3]) if masked else None
    ours = load_balancing_loss(logits, 8, top_k, mask)
    theirs = load_balancing_loss_func(tuple(logits), 8, top_k, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    ours_grads = torch.autograd.grad(ours, logits)
    for ours_grad, theirs_grad in zip(ours_grads, torch.autograd.grad(theirs, logits)):
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=0, atol=1e-7)
    if masked:  # padded rows carry no gradient
        assert all(grad.reshape(2, 7, 8)[1, 4:].abs().max() == 0 for grad in ours_grads)


@pytest.mark.parametrize("arch", list(MOE))
def test_packed_and_padded_aux_losses_equal_transformers_on_the_padded_batch(arch):
    """Measured (CPU, fp32): qwen3_moe packed 2.0119443 vs 2.0119445 (|diff| 2.4e-7), padded equal; mixtral equal."""
    model = tiny_moe(arch)
    module, segments = PackedCausalLM(model), random_segments([5, 9, 3, 30], 256)
    expected = transformers_aux(model, segments)
    module(collate_packed(segments))
    packed = module.router_aux_loss
    module(collate_padded(segments))
    padded = module.router_aux_loss
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(padded, expected, rtol=0, atol=1e-6)
    assert packed.requires_grad and 1.9 < float(expected.detach()) < 2.2  # top-2 of 4 balanced scores 2


def test_passes_without_gradients_ask_the_decoder_for_no_router_logits():
    """Reference, old-policy and reward passes run without gradients: ``output_router_logits=False`` is passed even
    where the config sets it True, so the routers' logits are never kept."""
    model = tiny_moe("qwen3_moe", output_router_logits=True)
    module, calls = PackedCausalLM(model), decoder_kwargs(model)
    batch = collate_packed(random_segments([4, 6], 256))
    with torch.no_grad():
        module(batch)
    assert calls[-1]["output_router_logits"] is False and module.router_aux_loss is None
    module(batch)
    assert calls[-1]["output_router_logits"] is True and module.router_aux_loss is not None


def test_a_dense_model_or_a_zero_coefficient_is_untouched():
    """Llama has no router: no ``output_router_logits`` reaches its decoder, and the SFT step logs no aux loss."""
    model = tiny_causal_lm("llama")
    module, calls = PackedCausalLM(model), decoder_kwargs(model)
    module(collate_packed(random_segments([4, 6], 256)))
    assert "output_router_logits" not in calls[-1]
    assert module.router is None and module.router_aux_loss is None
    assert PackedCausalLM(tiny_moe("mixtral", coef=0.0)).router is None
    metrics = sft_step(PackedCausalLM(model), packed=True)[0]
    assert "router_aux_loss" not in metrics


class RecordingEngine:
    """What a step function uses of DeepSpeed's engine: gradients accumulate, losses are recorded, nothing steps."""

    def __init__(self, module):
        from openpack.distributed.nonfinite import StepGuard

        self.module, self.losses, self.global_steps = module, [], 0
        self.step_guard = StepGuard()  # the step functions' non-finite check (distributed/nonfinite.py)
        self.step_guard.engine = self

    def __call__(self, batch, **kwargs):
        return self.module(batch, **kwargs)

    def set_gradient_accumulation_boundary(self, boundary):
        pass

    def backward(self, loss):
        self.losses.append(loss.detach())
        loss.backward()

    def step(self):
        self.step_guard.skips()  # decided as DeepSpeed's inner optimizer step asks; nothing steps here

    def was_step_applied(self):
        return True

    def get_lr(self):
        return [0.0]

    def zero_optimization_stage(self):
        return 0

    def bfloat16_enabled(self):
        return False


def plan(segments) -> RankStep:
    return RankStep(0, 0, MICRO_BATCHES, len(segments), sum(len(s.tokens) for s in segments),
                    (sum(s.num_labels for s in segments),), len(MICRO_BATCHES), None)


def sft_step(module, packed: bool, fused: bool = False):
    """One SFT step over MICRO_BATCHES: (its metrics read, the engine, the step)."""
    segments = random_segments(LENGTHS, 256, seed=3)
    engine, step = RecordingEngine(module), plan(segments)
    batcher = MicroBatcher(lambda i: [segments[i]], packing_samples=packed)
    return dict(train_step(engine, batcher, step, CPU, fused)), engine, step


def router_grads(module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if n.endswith("mlp.gate.weight")}
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("packed,fused", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("arch", list(MOE))
def test_sft_step_trains_and_logs_coef_times_the_token_weighted_aux_loss(arch, packed, fused):
    """With micro-batches m of tokens_m over a step of T = sum tokens_m real tokens:

        router_aux_loss = sum_m aux_m * tokens_m / T        (aux_m: transformers' on micro-batch m, padded)
        sum of the losses backpropagated = loss + coef * router_aux_loss
        router weights' gradient, coef c minus coef 0 = c * d router_aux_loss / d weight

    The aux loss is not linear in tokens, so unlike the LM loss it depends on the micro-batching (not tested)."""
    model = tiny_moe(arch)
    module, segments = PackedCausalLM(model), random_segments(LENGTHS, 256, seed=3)
    metrics, engine, step = sft_step(module, packed, fused)
    with_aux = router_grads(module)
    weighted = [transformers_aux(model, [segments[i] for i in ids]) * sum(LENGTHS[i] for i in ids) / step.real_tokens
                for ids in MICRO_BATCHES]
    expected = sum(weighted)
    assert step.real_tokens == sum(LENGTHS)
    assert metrics["router_aux_loss"] == pytest.approx(float(expected.detach()), abs=1e-6)
    assert float(sum(engine.losses)) == pytest.approx(metrics["loss"] + COEF * metrics["router_aux_loss"], abs=1e-5)
    expected.backward()
    aux_grads = router_grads(module)
    model.config.router_aux_loss_coef = 0.0
    metrics_without = sft_step(module, packed, fused)[0]
    without = router_grads(module)
    assert "router_aux_loss" not in metrics_without and metrics_without["loss"] == pytest.approx(metrics["loss"])
    for name, grad in with_aux.items():
        assert aux_grads[name].abs().max() > 1e-3, name
        torch.testing.assert_close(grad - without[name], COEF * aux_grads[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("packed", [True, False])
def test_dpo_step_adds_the_policy_aux_loss_and_the_reference_computes_none(packed):
    """Pairs (chosen, rejected) in micro-batches of 2, 1 and 3 pairs: the policy's step adds coef x the token-weighted
    aux loss and logs it; the reference model's no-grad pass is told ``output_router_logits=False`` although its
    config sets it True."""
    policy, reference = tiny_moe("qwen3_moe"), tiny_moe("qwen3_moe", seed=1, output_router_logits=True)
    pieces = random_segments([n for n in LENGTHS for _ in range(2)], 256, seed=4)
    pairs = [[Segment(pieces[2 * i].tokens, pieces[2 * i].targets, i, CHOSEN),
              Segment(pieces[2 * i + 1].tokens, pieces[2 * i + 1].targets, i, REJECTED)] for i in range(len(LENGTHS))]
    segments = [seg for pair in pairs for seg in pair]
    step = RankStep(0, 0, MICRO_BATCHES, len(pairs), sum(len(s.tokens) for s in segments),
                    tuple(sum(s.num_labels for s in segments if s.role == role) for role in (CHOSEN, REJECTED)),
                    len(MICRO_BATCHES), None)
    scorer = ModelReference(PackedCausalLM(reference), CPU.device)
    objective = PreferenceObjective(["sigmoid"], [1.0], LossParams(), scorer)
    engine, calls = RecordingEngine(PackedCausalLM(policy)), decoder_kwargs(reference)
    metrics = dict(dpo_step(engine, MicroBatcher(pairs.__getitem__, packed), objective, step, CPU))
    with torch.no_grad():
        expected = sum(transformers_aux(policy, [s for i in ids for s in pairs[i]]) * sum(
            len(s.tokens) for i in ids for s in pairs[i]) for ids in MICRO_BATCHES) / step.real_tokens
    assert metrics["router_aux_loss"] == pytest.approx(float(expected), abs=1e-6)
    assert float(sum(engine.losses)) == pytest.approx(metrics["loss"] + COEF * metrics["router_aux_loss"], abs=1e-5)
    assert len(calls) == len(MICRO_BATCHES) and all(call["output_router_logits"] is False for call in calls)


def test_gradient_checkpointing_keeps_the_aux_gradient():
    """The routers run inside checkpointed layers (non-reentrant, as ``load_causal_lm`` sets): the aux loss recorded
    in the forward still reaches their weights, the same as without checkpointing."""
    model = tiny_moe("qwen3_moe").train()
    module, batch = PackedCausalLM(model), collate_packed(random_segments([7, 12], 256))
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module(batch)
        module.router_aux_loss.backward()
        grads.append(router_grads(module))
    for name, grad in grads[0].items():
        assert grad.abs().max() > 1e-3
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-7, msg=name)


def rl_experience(segments) -> tuple[Experience, RLSettings]:
    """The segments as completions of a 2-token prompt each, advantage 1 on every token, no old-policy pass."""
    rollouts = Rollouts([list(s.tokens[:2]) for s in segments], [list(s.tokens[2:]) for s in segments],
                        [[0.0] * (len(s.tokens) - 2) for s in segments], [True] * len(segments))
    units, lengths = Units(rollouts, shared=False), rollouts.response_lengths()
    experience = Experience(rollouts=rollouts, units=units, batcher=MicroBatcher(units.segments, packing_samples=True),
                            lengths=lengths, behaviour=[torch.zeros(n) for n in lengths],
                            advantages=[torch.ones(n) for n in lengths],
                            values=dict(enumerate(torch.zeros(n) for n in lengths)),
                            returns=[torch.ones(n) for n in lengths])
    settings = RLSettings(n_samples_per_prompt=1, advantage_estimator="reinforce", loss_agg_mode="token_mean",
                          generate_max_len=32, policy=PolicyLossParams(), kl_coef=0.0, use_kl_loss=False)
    return experience, settings


def test_rl_policy_update_adds_the_aux_loss_and_the_critic_none():
    """``rl.update.policy_step``: the policy's step adds coef x the token-weighted aux loss (over each micro-batch's
    prompt and completion tokens) and logs it; the critic's step on the same MoE decoder (``packed_forward``
    outside ``PackedCausalLM``, as ``models/reward.py``) asks for no router logits and adds nothing."""
    model = tiny_moe("mixtral")
    segments = random_segments(LENGTHS, 256, seed=3)
    experience, settings = rl_experience(segments)
    step = RankStep(0, 0, MICRO_BATCHES, len(segments), sum(LENGTHS), (sum(experience.lengths),),
                    len(MICRO_BATCHES), None)
    engine = RecordingEngine(PackedCausalLM(model))
    metrics = dict(policy_step(engine, experience, step, settings, CPU))
    expected = sum(transformers_aux(model, [segments[i] for i in ids]) * sum(LENGTHS[i] for i in ids)
                   for ids in MICRO_BATCHES) / step.real_tokens
    assert metrics["router_aux_loss"] == pytest.approx(float(expected.detach()), abs=1e-6)
    assert metrics["policy_loss"] == pytest.approx(-1.0, abs=1e-6)  # ratio 1, advantage 1, token mean
    assert float(sum(engine.losses)) == pytest.approx(metrics["policy_loss"] + COEF * metrics["router_aux_loss"],
                                                      abs=1e-5)

    class ValueModel(torch.nn.Module):  # a critic's shape: hidden states -> one number per token
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, batch):
            return packed_forward(self.model, batch).sum(-1)

    calls = decoder_kwargs(model)
    assert "router_aux_loss" not in dict(critic_step(RecordingEngine(ValueModel()), experience, step, settings, CPU))
    assert calls and all(call["output_router_logits"] is False for call in calls)
