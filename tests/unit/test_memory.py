"""The step memory estimate: its formula against the tensors autograd really saves, and the warning it drives.

The defect (issue 12): the default ``--max_tokens_per_gpu 16384`` got a 135M model OOM-killed on a
24 GiB CPU machine with exit 137 and no message. Now the budget is checked before the first step.
"""

import pytest
import torch

from openpack.core.batch import Segment, collate_packed
from openpack.models.memory import (CPU_ACTIVATION_FLOOR, GIB, ROW_CAP, activation_numbers_per_token, budget_warning,
                                    default_row_cap, step_memory)
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm, tiny_config

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, tie_word_embeddings=True)


def saved_numbers_per_token(model, tokens: int) -> float:
    """Numbers autograd saves for the backward per token of a packed row, parameters excluded (two sizes, so
    whatever does not grow with the row cancels)."""
    params = {p.data_ptr() for p in model.parameters()}

    def saved(length):
        segments = [Segment(list(range(3, 3 + length // 4)), [False, False] + [True] * (length // 4 - 2), i)
                    for i in range(4)]
        seen = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: seen.setdefault((t.data_ptr(), t.dtype, tuple(t.shape)), t.numel()) and t, lambda t: t):
            PackedCausalLM(model)(collate_packed(segments))
        return sum(n for (ptr, _, _), n in seen.items() if ptr not in params)

    return (saved(2 * tokens) - saved(tokens)) / tokens


@pytest.mark.parametrize("widths", [dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8),
                                    dict(hidden_size=192, intermediate_size=512, num_attention_heads=6,
                                         num_key_value_heads=3)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_formula_matches_what_autograd_saves(widths, checkpointing):
    model = tiny_causal_lm("llama", vocab_size=300, num_hidden_layers=3, max_position_embeddings=2048, **widths).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    measured = saved_numbers_per_token(model, 256)
    predicted = activation_numbers_per_token(model.config, checkpointing)
    # checkpointed: the formula counts one layer's recompute, which is alive in the backward but not saved here
    expected = measured + (0 if not checkpointing else predicted - (3 + 3) * widths["hidden_size"])
    assert abs(predicted - expected) / expected < 0.05, (predicted, measured)


def test_the_issue_case_is_warned_about_with_numbers_and_fixes():
    """SmolLM2-135M, fp32, 16384 tokens per micro-batch, one rank on a 24 GiB machine."""
    config = tiny_config("llama", vocab_size=49152, **SMOLLM2_135M)
    need = step_memory(config, 134_515_008, bf16=False, gradient_checkpointing=False, zero_stage=2, world_size=1)
    checkpointed = step_memory(config, 134_515_008, False, True, 2, 1)
    warning = budget_warning(need, 16384, 24 * GIB, "--max_tokens_per_gpu", "this machine's memory", checkpointed)
    assert warning is not None
    assert need.total(16384) > 24 * GIB
    assert warning.startswith(f"memory: --max_tokens_per_gpu 16384 needs about {need.total(16384) / GIB:.1f} GiB")
    assert "but this machine's memory has 24.0 GiB for it" in warning
    fits = int(warning.split("lower --max_tokens_per_gpu to about ")[1].split()[0])
    assert 8000 < fits < 16384 and need.total(fits) <= 0.9 * 24 * GIB < need.total(fits + 100)
    assert "pass --gradient_checkpointing" in warning
    assert budget_warning(need, 4096, 24 * GIB, "--max_tokens_per_gpu", "this machine's memory") is None


def test_rl_default_row_cap_holds_activations_to_the_states_on_cpu_and_to_the_budget_on_a_gpu():
    """grpo_vs_trl.py's 9.8M Llama on CPU: rows whose activations weigh what the weights, gradients and AdamW states
    do (~157 MB at ~209 KiB a token: about 750 tokens, not one row of 16384); SmolLM2-135M in bf16 on an 80 GiB GPU:
    the 16384 ceiling; on a 4 GiB one: what fits 90% of it; and never below one prompt + completion."""
    config = tiny_config("llama", vocab_size=46, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2)
    need = step_memory(config, 9_770_000, False, False, zero_stage=2, world_size=1)
    cap, why = default_row_cap(need, need.states, 24 * GIB, cpu=True, longest=38)
    assert 700 < cap < 800 and why == "activations no larger than the model's weights, gradients and optimizer states"
    assert cap * need.per_token + cap * need.logits_per_token <= need.states
    assert (cap + 1) * (need.per_token + need.logits_per_token) > need.states
    assert default_row_cap(need, need.states, 24 * GIB, cpu=True, longest=448) == \
        (4 * 448, "room for 4 of the longest prompt + completion")  # issue 26's long prompts: 4 samples a row
    assert default_row_cap(need, need.states, 24 * GIB, cpu=False, longest=20000) == \
        (20000, f"the longest prompt + completion (tighter: at most {ROW_CAP}, {ROW_CAP} tokens)")
    small = step_memory(tiny_config("llama", vocab_size=46, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=3), 460_000, False, False, 2, 1)  # the demo model
    cap, why = default_row_cap(small, small.states, 24 * GIB, cpu=True, longest=38)  # states: 7.4 MB
    assert (cap, why) == (small.activation_tokens(CPU_ACTIVATION_FLOOR), "activations no larger than 128 MiB on CPU")
    assert cap > 1713  # the demo's GRPO step (1.7k tokens) stays one row
    smol = tiny_config("llama", vocab_size=49152, **SMOLLM2_135M)
    bf16 = step_memory(smol, 134_515_008, True, False, 2, 1)
    assert default_row_cap(bf16, bf16.states, 80 * GIB, cpu=False, longest=512) == (ROW_CAP, f"at most {ROW_CAP}")
    cap, why = default_row_cap(bf16, bf16.states, 4 * GIB, cpu=False, longest=512)
    assert why == "90% of the device's memory" and bf16.total(cap) <= 0.9 * 4 * GIB < bf16.total(cap + 1)
    # a vocabulary so large that the logits chunk fills before the row does: tokens past it cost activations only
    wide = step_memory(tiny_config("llama", vocab_size=2_000_000), 10**9, False, False, 2, 1)
    tokens = wide.activation_tokens(wide.states)
    assert tokens * wide.per_token + wide.logits_cap <= wide.states < (tokens + 1) * wide.per_token + wide.logits_cap


def test_zero_partitions_the_states_over_ranks():
    config = tiny_config("llama", vocab_size=1000)
    one = step_memory(config, 10**6, False, False, zero_stage=0, world_size=4)
    assert one.states == 16 * 10**6
    assert step_memory(config, 10**6, False, False, 1, 4).states == 8 * 10**6 + 2 * 10**6
    assert step_memory(config, 10**6, False, False, 2, 4).states == 4 * 10**6 + 3 * 10**6
    assert step_memory(config, 10**6, False, False, 3, 4).states == 4 * 10**6
    assert step_memory(config, 10**6, True, False, 0, 1, adam_offload=True).states == 4 * 10**6


def test_under_lora_only_the_adapters_and_a_reward_head_get_gradients_and_adam_states(tmp_path):
    """Tiny Llama (vocab 256, h 64, MLP 128, 2 layers, kv 2 x 16 = 32, untied head), LoRA rank 4 on all-linear.

    Weights: embedding 256*64 = 16384, per layer q, o 64*64 = 4096 each, k, v 64*32 = 2048 each, gate, up, down
    64*128 = 8192 each, two norms 2*64 = 128: 36992; final norm 64; LM head 256*64 = 16384. Base: 16384 + 2*36992 +
    64 + 16384 = 106816. Adapters, r (in + out) per linear: q, o 4*128 = 512, k, v 4*96 = 384, gate, up, down
    4*192 = 768: 4096 per layer, 8192 in all. fp32, ZeRO-0, one rank: 4 bytes of weight for every parameter, 4 of
    gradient and 8 of AdamW moments for the 8192 adapters only:
    4 * (106816 + 8192) + 12 * 8192 = 460032 + 98304 = 558336 (counting all as trained: 16 * 115008 = 1840128).
    A reward model has no LM head (106816 - 16384 = 90432) but a score head 64 -> 1, kept and trained as a copy
    (peft's modules_to_save): 4 * (90432 + 64 + 64 + 8192) + 12 * (8192 + 64) = 395008 + 99072 = 494080.
    """
    from types import SimpleNamespace

    from openpack.models.lora import apply_lora
    from openpack.models.reward import load_reward_model
    from openpack.trainers.batching import training_memory

    cfg = SimpleNamespace(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=["all-linear"], bf16=False,
                          zero_stage=0, adam_offload=False)
    assert training_memory(tiny_causal_lm("llama"), cfg, 1, False).states == 16 * 106816  # no LoRA: all train
    policy = apply_lora(tiny_causal_lm("llama"), cfg)
    assert training_memory(policy, cfg, 1, False).states == 558336
    assert training_memory(policy, cfg, 1, False, frozen_params=1000).states == 558336 + 4 * 1000  # a reference
    tiny_causal_lm("llama").save_pretrained(tmp_path)
    reward = apply_lora(load_reward_model(str(tmp_path), pad_token_id=0), cfg, head="score")
    assert training_memory(reward, cfg, 1, False).states == 494080


def test_a_memory_kill_under_the_automatic_row_cap_advises_a_flag_not_none():
    """RL leaves --max_tokens_per_gpu at None (automatic): the Ray launcher's advice after a memory kill must not
    read "lower --max_tokens_per_gpu None" (nor fail on None // 2)."""
    from types import SimpleNamespace

    from openpack.orchestration.launch import memory_advice

    auto = SimpleNamespace(max_tokens_per_gpu=None, use_dynamic_batch=True, micro_train_batch_size=1)
    assert memory_advice((auto,)) == ("pass --max_tokens_per_gpu below the automatic cap the run logged at start "
                                      "(try half of it)")
    fixed = SimpleNamespace(max_tokens_per_gpu=4096, use_dynamic_batch=True, micro_train_batch_size=1)
    assert memory_advice((fixed,)) == "lower --max_tokens_per_gpu 4096 (try 2048)"
