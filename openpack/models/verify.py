"""The reference a packed forward must equal: each segment alone, through transformers' eager attention.

Used by the equivalence tests and by ``openpack check_packing``, which runs the
same comparison on whatever device and dtype a user has (that is how the CUDA
backends are checked on a GPU).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from openpack.core.batch import Segment, collate_packed
from openpack.models.packed import packed_token_logprobs


def random_segments(lengths, vocab_size: int, seed: int = 0) -> list[Segment]:
    """Random token segments, every token after the first a target."""
    generator = torch.Generator().manual_seed(seed)
    return [
        Segment(torch.randint(0, vocab_size, (n,), generator=generator).tolist(), [True] * n, sample_index=i)
        for i, n in enumerate(lengths)
    ]


@contextmanager
def attention_implementation(model, name: str):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def reference_token_logprobs(model, segments: list[Segment]) -> torch.Tensor:
    """Per-token log-probs laid out like a packed row, from one unpacked eager forward per segment."""
    device = next(model.parameters()).device
    labels = collate_packed(segments).labels[0].to(device)
    pieces = []
    with attention_implementation(model, "eager"):
        for seg in segments:
            ids = torch.tensor([list(seg.tokens)], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0]
            pieces.append(torch.log_softmax(logits.float(), dim=-1))
    logp = torch.cat(pieces)
    picked = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(labels >= 0, picked, torch.zeros_like(picked))


def packed_vs_unpacked(model, lengths, seed: int = 0) -> dict:
    """Max absolute differences of log-probs and of the gradients of their sum."""
    segments = random_segments(lengths, model.config.vocab_size, seed)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    packed = packed_token_logprobs(model, collate_packed(segments).to(device))
    g_packed = torch.autograd.grad(packed.sum(), params)
    reference = reference_token_logprobs(model, segments)
    g_ref = torch.autograd.grad(reference.sum(), params)
    grad_error = max(((a.float() - b.float()).abs().max().item() for a, b in zip(g_packed, g_ref)), default=0.0)
    grad_scale = max((b.float().abs().max().item() for b in g_ref), default=0.0)
    return {
        "logprob_max_abs_error": (packed - reference).abs().max().item(),
        "grad_max_abs_error": grad_error,
        "grad_max_abs": grad_scale,
        "tokens": sum(lengths),
        "segments": len(lengths),
    }
