"""Tiny random-init causal LMs built from a config: tests and demos, no downloads.

Each architecture keeps the features that matter for packing: grouped-query
attention (4 query heads over 2 KV heads), rotary positions, Qwen2's QKV
bias, and Mistral's sliding window (8 tokens, shorter than most test
segments, so the window is really exercised).
"""

from __future__ import annotations

import torch

from openpack.models.attention import register_packed_attention

TINY_ARCHS = ("llama", "qwen2", "mistral")

# The family support matrix (``models.families``, docs/models.md): name -> (model_type, the features switched on).
# Windows of 8 tokens and original contexts of 32 are shorter than the segments the checks pack, so windows slide
# and length-dependent rope types really change regime inside one row.
_SHORT_FACTORS = [1.0 + 0.1 * i for i in range(8)]
_LONG_FACTORS = [2.0 + 0.3 * i for i in range(8)]
FAMILIES = {
    "llama": ("llama", {}),
    "llama_llama3_rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama_yarn_rope": ("llama", dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32))),
    "llama_dynamic_rope": ("llama", dict(max_position_embeddings=32, tie_word_embeddings=True,
                                         rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "qwen2_sliding_window": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    router_aux_loss_coef=0.01)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                router_aux_loss_coef=0.01)),
    "mistral": ("mistral", dict(sliding_window=8)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, tie_word_embeddings=True,
                              final_logit_softcapping=2.0, attn_logit_softcapping=1.0)),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, sliding_window_pattern=2,
                                   tie_word_embeddings=True, final_logit_softcapping=2.0, attn_logit_softcapping=1.0)),
    "phi3": ("phi3", dict(sliding_window=8)),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
        short_factor=_SHORT_FACTORS, long_factor=_LONG_FACTORS))),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.25)),
    "falcon": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # refused: see models.families
}


def tiny_config(arch: str, vocab_size: int = 256, **overrides):
    """A tiny config of ``arch``: one of TINY_ARCHS, or a FAMILIES name with its features on."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHS and arch not in FAMILIES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHS + tuple(FAMILIES)}")
    model_type, features = FAMILIES.get(arch, (arch, {}))
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        fields["sliding_window"] = 8
    if arch not in TINY_ARCHS:  # the TINY_ARCHS models stay as they were: demos and tests are built on them
        fields.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, **features)
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def tiny_causal_lm(arch: str, seed: int = 0, dtype=torch.float32, attn_implementation: str | None = None, **overrides):
    """A random-init model with openpack's packed attention (or the implementation asked for)."""
    from transformers import AutoModelForCausalLM

    implementation = attn_implementation or register_packed_attention()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, **overrides), attn_implementation=implementation, dtype=dtype
    )
    return model.eval()
