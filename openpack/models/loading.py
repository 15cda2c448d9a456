"""Load a Hugging Face causal LM and tokenizer with openpack's packed attention."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from openpack.models.attention import register_packed_attention
from openpack.models.errors import ModelLoadError
from openpack.models.families import check_model_family
from openpack.models.memory import mark_memory


def _check_source(pretrain: str, flag: str) -> None:
    looks_local = pretrain.startswith((".", "/", "~")) or pretrain.count("/") > 1
    if looks_local and not Path(pretrain).expanduser().is_dir():
        raise ModelLoadError(f"{flag} {pretrain}: no such folder (a local path must be a saved HF model folder)")


def _from_pretrained(loader, pretrain: str, what: str, flag: str = "--pretrain", **kwargs):
    _check_source(pretrain, flag)
    quiet_progress_bars()
    try:
        return loader.from_pretrained(pretrain, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"{flag} {pretrain}: could not load the {what} ({err}); give a local HF model folder, "
            "or a hub name on a machine with network access"
        ) from err


def quiet_progress_bars() -> None:
    """No transformers tqdm bars ("Loading weights", "Writing model shards") unless stderr is a terminal: in a Ray
    actor stderr is a file the driver replays line by line, so each bar became lines of console (issue 24)."""
    if sys.stderr.isatty():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model_config(pretrain: str, flag: str = "--pretrain"):
    """Only the model's ``config.json`` (a few KB): how the driver checks a model flag before anything starts."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, pretrain, "config", flag)


def load_tokenizer(pretrain: str, flag: str = "--pretrain"):
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, pretrain, "tokenizer", flag)
    if tokenizer.pad_token_id is None:  # padding is only used for the unpacked baseline and generation
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_difference(ours, theirs) -> str | None:
    """Where two tokenizers give a token id different meanings, in a few words; None where they agree. Compared:
    the vocabulary (every token and its id, added tokens included) and the special tokens other than padding
    (bos, eos, unk and any extra ones; padding is never scored)."""
    vocab, other = ours.get_vocab(), theirs.get_vocab()
    if vocab != other:
        moved = sum(1 for token in vocab.keys() & other.keys() if vocab[token] != other[token])
        return (f"vocabularies of {len(vocab)} and {len(other)} tokens ({len(vocab.keys() - other.keys())} and "
                f"{len(other.keys() - vocab.keys())} tokens of one only, {moved} shared tokens with other ids)")
    for name in ("bos_token", "eos_token", "unk_token"):
        if getattr(ours, name, None) != getattr(theirs, name, None):
            return f"{name} {getattr(ours, name, None)!r} and {getattr(theirs, name, None)!r}"
    specials = [set(t.all_special_tokens) - ({t.pad_token} - {t.bos_token, t.eos_token, t.unk_token})
                for t in (ours, theirs)]  # a pad that is also eos stays: eos is scored
    if specials[0] != specials[1]:
        return f"special tokens {sorted(specials[0] - specials[1])} and {sorted(specials[1] - specials[0])}"
    return None


def load_causal_lm(pretrain: str, bf16: bool = False, gradient_checkpointing: bool = False, flag: str = "--pretrain",
                   load_in_4bit: bool = False, aux_loss_coef: float | None = None):
    """``AutoModelForCausalLM.from_pretrained`` with ``attn_implementation="openpack_varlen"``; errors name ``flag``.

    ``load_in_4bit``: QLoRA's frozen 4-bit base on this process's GPU (``models.lora``). ``aux_loss_coef``
    (``--aux_loss_coef``) sets the config's ``router_aux_loss_coef`` (saved with the model)."""
    from transformers import AutoModelForCausalLM

    check_model_family(load_model_config(pretrain, flag), flag)  # library callers too: refused before the weights
    mark_memory(f"before loading {flag}")
    model = _from_pretrained(
        AutoModelForCausalLM, pretrain, "model", flag,
        attn_implementation=register_packed_attention(), dtype=torch.bfloat16 if bf16 else torch.float32,
        **quantized(load_in_4bit, bf16),
    )
    if aux_loss_coef is not None:
        model.config.router_aux_loss_coef = aux_loss_coef
    mark_memory(f"{flag} loaded")
    return prepare_for_training(model, gradient_checkpointing)


def quantized(load_in_4bit: bool, bf16: bool) -> dict:
    """from_pretrained's arguments for a 4-bit base (QLoRA), placed on the current GPU; {} otherwise."""
    if not load_in_4bit:
        return {}
    from openpack.models.lora import check_4bit_available, quantization_config

    check_4bit_available()
    return {"quantization_config": quantization_config(bf16), "device_map": {"": torch.cuda.current_device()}}


def prepare_for_training(model, gradient_checkpointing: bool = False):
    model.config.use_cache = False  # training forwards never use a KV cache (see models/attention.py)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
