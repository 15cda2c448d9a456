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


def tiny_config(arch: str, vocab_size: int = 256, **overrides):
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHS}")
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
    fields.update(overrides)
    return AutoConfig.for_model(arch, **fields)


def tiny_causal_lm(arch: str, seed: int = 0, dtype=torch.float32, attn_implementation: str | None = None, **overrides):
    """A random-init model with openpack's packed attention (or the implementation asked for)."""
    from transformers import AutoModelForCausalLM

    implementation = attn_implementation or register_packed_attention()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, **overrides), attn_implementation=implementation, dtype=dtype
    )
    return model.eval()
