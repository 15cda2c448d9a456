"""Rotary frequencies per sequence, for the rope types whose frequencies depend on a sequence's length.

transformers' ``dynamic`` NTK and Phi-3's ``longrope`` pick their frequencies from ``max(position_ids) + 1``
of the whole forward (``modeling_rope_utils.dynamic_rope_update``). In a packed row that is the longest segment's
length, so a short segment beside a long one got the long-context frequencies (measured on a tiny Phi-3 longrope:
0.0039 log-prob error, 0.08 gradient error; issue 28); a padded batch shares one position range the same way.
``dynamic`` is also stateful: after a long forward, a shorter one keeps the long frequencies.

``per_sequence_rope`` gives each sequence the frequencies it gets alone on a fresh model: within the context,
each such rotary module computes cos/sin once per distinct regime (longrope: short or long factors; dynamic:
each length above the original context) with the module's own forward, and each token takes its sequence's.
A prompt shared by several sequences (``--prefix_sharing``) cannot have one regime per sequence: those runs are
refused (``check_rope_for_prefix_sharing``, from the config before anything loads).
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager

import torch

LENGTH_DEPENDENT = ("dynamic", "longrope")


def _length_dependent(rope_type) -> bool:
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def config_rope_types(config) -> list[str]:
    """Every rope type a config names (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "rope_type" in params or "type" in params:
        return [params.get("rope_type", params.get("type"))]
    return [p.get("rope_type", "default") for p in params.values() if isinstance(p, dict)]


def length_dependent_rope(config) -> str | None:
    """The rope type whose frequencies depend on a sequence's length, or None."""
    return next((t for t in config_rope_types(config) if _length_dependent(t)), None)


def check_rope(config, prefix_sharing: bool = False, flag: str = "--pretrain") -> None:
    """Refuse, from the config alone, what per-sequence frequencies cannot make exact."""
    rope_type = length_dependent_rope(config)
    if rope_type is None:
        return
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" not in params and "type" not in params:
        raise ValueError(f"{flag}: rope type {rope_type!r} on some layer types only; openpack computes "
                         "length-dependent rotary frequencies per sequence for a single rope type")
    if prefix_sharing:
        raise ValueError(f"{flag}: rope type {rope_type!r} picks its frequencies from each sequence's length, so a "
                         "prompt shared by sequences of different lengths has no single exact encoding; "
                         "turn --prefix_sharing off")


_modules_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rotary_modules(model) -> list[torch.nn.Module]:
    """The model's length-dependent rotary modules (looked up once per model: this runs every forward)."""
    if model not in _modules_of:
        _modules_of[model] = [m for m in model.modules()
                              if _length_dependent(getattr(m, "rope_type", None)) and hasattr(m, "original_inv_freq")]
    return _modules_of[model]


def _inverse_frequencies(module, length: int, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of a sequence of ``length`` on a fresh model."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if module.rope_type == "longrope":
        threshold = module.config.rope_parameters["original_max_position_embeddings"]
        seq_len = threshold + 1 if length > threshold else None
    else:
        seq_len = length if length > module.original_max_seq_len else None
    return ROPE_INIT_FUNCTIONS[module.rope_type](module.config, device, seq_len=seq_len)


def _regimes(module, lengths: torch.Tensor) -> torch.Tensor:
    """Lengths of one regime share frequencies: longrope has two, dynamic one per length above the original."""
    if module.rope_type == "longrope":
        return (lengths > module.config.rope_parameters["original_max_position_embeddings"]).long()
    return torch.where(lengths > module.original_max_seq_len, lengths, 0)


def _per_sequence_forward(module, raw_forward, lengths: torch.Tensor):
    """``lengths``: each token's sequence length, broadcastable to the position ids ([1, T] packed, [B, 1] padded)."""
    regimes = _regimes(module, lengths)
    representative = {}  # regime -> a length in it
    for regime, length in zip(regimes.flatten().tolist(), lengths.flatten().tolist()):
        representative.setdefault(regime, length)

    def forward(x, position_ids, *args, **kwargs):
        cos = sin = None
        saved = module.inv_freq, module.attention_scaling
        try:
            for regime, length in representative.items():
                module.inv_freq, module.attention_scaling = _inverse_frequencies(module, length, x.device)
                c, s = raw_forward(module, x, position_ids, *args, **kwargs)
                if cos is None:
                    cos, sin = c, s
                else:
                    mine = (regimes.to(x.device) == regime)[..., None]
                    cos, sin = torch.where(mine, c, cos), torch.where(mine, s, sin)
        finally:
            module.inv_freq, module.attention_scaling = saved
        return cos, sin

    return forward


@contextmanager
def per_sequence_rope(model, batch):
    """Within the context, length-dependent rotary modules of ``model`` encode each token of ``batch`` (a
    PackedBatch or PaddedBatch) by its own sequence's length; other models are untouched."""
    modules = _rotary_modules(model)
    if modules:
        if getattr(batch, "shared_prefix", None) is not None:
            check_rope(model.config, prefix_sharing=True)
        lengths = packed_lengths(batch) if hasattr(batch, "cu_seqlens") else padded_lengths(batch.attention_mask)
    for module in modules:
        raw = inspect.unwrap(type(module).forward)  # under no_grad and dynamic_rope_update: cos/sin from inv_freq
        module.forward = _per_sequence_forward(module, raw, lengths)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def packed_lengths(batch) -> torch.Tensor:
    """[1, T]: each token's sequence length (its segment's last position + 1) in a packed row; in one rank's part
    of a row split over a context group, its segment's whole length."""
    shard = getattr(batch, "context_shard", None)
    if shard is not None:
        return shard.segment_lengths.to(batch.segment_ids.device)[batch.segment_ids][None]
    cu = batch.cu_seqlens.long()
    ends = batch.position_ids[0].index_select(0, cu[1:] - 1) + 1
    return ends.repeat_interleave(cu[1:] - cu[:-1])[None]


def padded_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each right-padded row's real length."""
    return attention_mask.sum(dim=1, keepdim=True)


@contextmanager
def fresh_rope_state(model):
    """Length-dependent rotary modules are reset to their initial state when the context exits (transformers'
    ``dynamic`` keeps the frequencies of the longest forward so far)."""
    saved = [(m, dict(m.__dict__), dict(m._buffers)) for m in _rotary_modules(model)]
    try:
        yield
    finally:
        for module, attributes, buffers in saved:
            module.__dict__.update(attributes)
            module._buffers = buffers
