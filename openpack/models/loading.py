"""Load a Hugging Face causal LM and tokenizer with openpack's packed attention."""

from __future__ import annotations

import torch

from openpack.models.attention import register_packed_attention


def load_tokenizer(pretrain: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrain)
    if tokenizer.pad_token_id is None:  # padding is only used for the unpacked baseline and generation
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(pretrain: str, bf16: bool = False, gradient_checkpointing: bool = False):
    """``AutoModelForCausalLM.from_pretrained`` with ``attn_implementation="openpack_varlen"``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        pretrain, attn_implementation=register_packed_attention(), dtype=torch.bfloat16 if bf16 else torch.float32
    )
    return prepare_for_training(model, gradient_checkpointing)


def prepare_for_training(model, gradient_checkpointing: bool = False):
    model.config.use_cache = False  # training forwards never use a KV cache (see models/attention.py)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
