"""The reference a packed forward must equal: each segment alone, through transformers' eager attention.

Used by the equivalence tests and by ``openpack check_packing``, which runs the
same comparison on whatever device and dtype a user has (that is how the CUDA
backends are checked on a GPU).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from openpack.core.batch import CHOSEN, PROMPT, Segment, collate_packed
from openpack.models.attention import resolve_backend
from openpack.models.packed import packed_token_logprobs
from openpack.models.rope import fresh_rope_state, length_dependent_rope
from openpack.models.tiny import tiny_causal_lm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_segments(lengths, vocab_size: int, seed: int = 0) -> list[Segment]:
    """Random token segments, every token after the first a target."""
    generator = torch.Generator().manual_seed(seed)
    return [
        Segment(torch.randint(0, vocab_size, (n,), generator=generator).tolist(), [True] * n, sample_index=i)
        for i, n in enumerate(lengths)
    ]


def shared_prefix_mask(batch, window: int | None = None) -> torch.Tensor:
    """The block mask of a prefix-shared packed row, [T, T] bool (row attends to column): the reference the
    two-pass kernels of ``models.attention`` are tested against.

    A row sees columns of its own segment and of the prompt its segment follows, at positions <= its own and,
    with a ``window``, within ``window`` positions of it (Mistral's window, in position space).
    """
    segment = batch.segment_ids
    prompt = batch.shared_prefix.prompt_segment[segment]  # [T]: the prompt each row's segment follows, or -1
    position = batch.position_ids[0]
    same = segment[:, None] == segment[None, :]
    of_prompt = prompt[:, None] == segment[None, :]
    distance = position[:, None] - position[None, :]
    visible = (same | of_prompt) & (distance >= 0)
    return visible & (distance < window) if window else visible


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
            with fresh_rope_state(model):  # each segment alone on a fresh model (dynamic rope keeps state)
                logits = model(input_ids=ids, use_cache=False).logits[0]
            pieces.append(torch.log_softmax(logits.float(), dim=-1))
    logp = torch.cat(pieces)
    picked = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(labels >= 0, picked, torch.zeros_like(picked))


def _logprobs_and_grads(model, segments, packed: bool):
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    if packed:
        logprobs = packed_token_logprobs(model, collate_packed(segments).to(device))
    else:
        logprobs = reference_token_logprobs(model, segments)
    return logprobs.float(), [g.float() for g in torch.autograd.grad(logprobs.sum(), params)]


def _max_error(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def packed_vs_unpacked(model, lengths, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Errors of log-probs and of the gradients of their sum against an fp32 unpacked reference.

    ``model`` is fp32; the packed forward runs in ``dtype``. In a lower precision
    the unpacked forward in that dtype is measured too, as the error budget
    the precision itself costs (0 in fp32, where it is the reference).
    """
    segments = random_segments(lengths, model.config.vocab_size, seed)
    ref_logprobs, ref_grads = _logprobs_and_grads(model, segments, packed=False)
    low = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    packed_logprobs, packed_grads = _logprobs_and_grads(low, segments, packed=True)
    result = {
        "tokens": sum(lengths),
        "segments": len(lengths),
        "packed_logprob_error": (packed_logprobs - ref_logprobs).abs().max().item(),
        "packed_grad_error": _max_error(packed_grads, ref_grads),
        "logprob_scale": ref_logprobs.abs().max().item(),
        "grad_scale": max(g.abs().max().item() for g in ref_grads),
        "unpacked_logprob_error": 0.0,
        "unpacked_grad_error": 0.0,
    }
    if dtype != torch.float32:
        low_logprobs, low_grads = _logprobs_and_grads(low, segments, packed=False)
        result["unpacked_logprob_error"] = (low_logprobs - ref_logprobs).abs().max().item()
        result["unpacked_grad_error"] = _max_error(low_grads, ref_grads)
    return result


def within_error_budget(result: dict, tolerance: float = 1e-5) -> bool:
    """Packing adds no error beyond ``tolerance`` plus twice what the dtype itself costs.

    In fp32 the dtype costs nothing, so this is ``error <= tolerance``, relative
    to the largest magnitude when that exceeds 1, for log-probs and gradients
    alike. fp32 rounding grows with magnitude: SmolLM2-135M (vocabulary 49,152,
    log-probs down to -25) differed by 3.4e-5 packed against one at a time, and
    by 1.5e-5 with its weights in float64 (the fp32 log-softmax over 49,152
    logits alone), where a packing fault costs 1e-3 to 1 (docs/models.md).
    """
    logprob_budget = tolerance * max(1.0, result["logprob_scale"]) + 2 * result["unpacked_logprob_error"]
    grad_budget = tolerance * max(1.0, result["grad_scale"]) + 2 * result["unpacked_grad_error"]
    return result["packed_logprob_error"] <= logprob_budget and result["packed_grad_error"] <= grad_budget


def random_groups(groups, vocab_size: int, seed: int = 0) -> tuple[list[Segment], list[Segment]]:
    """(shared, alone) segments of prompt groups: ``groups`` is [(prompt length, [completion lengths])].

    Shared: each prompt once, then its completions after it (``--prefix_sharing``); alone: prompt + completion
    per completion. The completions' tokens are the targets in both.
    """
    generator = torch.Generator().manual_seed(seed)
    shared, alone = [], []
    for sample, (prompt_length, completion_lengths) in enumerate(groups):
        prompt = torch.randint(0, vocab_size, (prompt_length,), generator=generator).tolist()
        shared.append(Segment(prompt, [False] * prompt_length, sample, PROMPT))
        for n in completion_lengths:
            completion = torch.randint(0, vocab_size, (n,), generator=generator).tolist()
            shared.append(Segment(completion, [True] * n, sample, CHOSEN, after_prompt=True))
            alone.append(Segment(prompt + completion, [False] * prompt_length + [True] * n, sample))
    return shared, alone


def _alone_sums_and_grads(model, alone: list[Segment]):
    """Each segment's summed log-prob through eager attention alone, and the gradients of their total."""
    logprobs = reference_token_logprobs(model, alone).float()
    ends = torch.tensor([len(s.tokens) for s in alone]).cumsum(0)[:-1].tolist()
    sums = torch.stack([piece.sum() for piece in logprobs.tensor_split(ends)])
    params = [p for p in model.parameters() if p.requires_grad]
    return sums, [g.float() for g in torch.autograd.grad(sums.sum(), params)]


def shared_vs_unpacked(model, groups, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """``packed_vs_unpacked`` for prefix sharing: each completion's summed log-prob, and the gradients of their
    total, from one shared packed row against prompt + completion alone through eager attention (fp32; in a
    lower ``dtype`` that alone-path is measured too, as the dtype's own error budget)."""
    shared, alone = random_groups(groups, model.config.vocab_size, seed)
    device = next(model.parameters()).device
    ref_sums, ref_grads = _alone_sums_and_grads(model, alone)
    low = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    batch = collate_packed(shared).to(device)
    logprobs = packed_token_logprobs(low, batch).float()
    completions = torch.tensor([s.role == CHOSEN for s in shared], device=device)
    sums = torch.zeros(batch.num_segments, device=device).index_add(0, batch.segment_ids, logprobs)[completions]
    grads = torch.autograd.grad(sums.sum(), [p for p in low.parameters() if p.requires_grad])
    result = {
        "tokens": batch.num_tokens,
        "unshared_tokens": sum(len(s.tokens) for s in alone),
        "packed_logprob_error": (sums - ref_sums).abs().max().item(),
        "packed_grad_error": _max_error([g.float() for g in grads], ref_grads),
        "logprob_scale": ref_sums.abs().max().item(),
        "grad_scale": max(g.abs().max().item() for g in ref_grads),
        "unpacked_logprob_error": 0.0,
        "unpacked_grad_error": 0.0,
    }
    if dtype != torch.float32:
        low_sums, low_grads = _alone_sums_and_grads(low, alone)
        result["unpacked_logprob_error"] = (low_sums - ref_sums).abs().max().item()
        result["unpacked_grad_error"] = _max_error(low_grads, ref_grads)
    return result


def load_checked(arch: str | None, cfg):
    """The model to check: ``--pretrain`` in fp32 (the reference; refused before its weights load if its family
    cannot pack exactly), else the tiny ``arch``."""
    if arch is None:
        from openpack.models.loading import load_causal_lm

        return load_causal_lm(cfg.pretrain).eval()
    return tiny_causal_lm(arch, seed=cfg.seed)


def shared_groups(lengths: list[int]) -> list[tuple[int, list[int]]]:
    """--lengths as groups of a prompt and up to 3 completions: [7, 13, 1, 20, 5] -> [(7, [13, 1, 20]), (5, [])]."""
    return [(lengths[i], lengths[i + 1:i + 4]) for i in range(0, len(lengths), 4)]


def check_arch(arch: str | None, cfg, device: torch.device) -> list[dict]:
    """``openpack check_packing`` on one model (``cfg``: its ``CheckPackingConfig``): one result per layout
    checked, packed segments, then (``--prefix_sharing``) a prefix-shared row."""
    model = load_checked(arch, cfg).to(device)
    head = {"arch": arch or cfg.pretrain, "device": str(device), "dtype": cfg.dtype,
            "backend": resolve_backend(device, DTYPES[cfg.dtype])}
    results = [{**head, "layout": "packed", **packed_vs_unpacked(model, cfg.lengths, cfg.seed, DTYPES[cfg.dtype])}]
    groups = [g for g in shared_groups(cfg.lengths) if g[1]]
    if cfg.prefix_sharing and groups and length_dependent_rope(model.config) is None:
        results.append({**head, "layout": "prefix_shared",
                        **shared_vs_unpacked(model, groups, cfg.seed, DTYPES[cfg.dtype])})
    for result in results:
        result["passed"] = within_error_budget(result, cfg.tolerance)
    return results


def packing_verdict(results: list[dict], device: torch.device, cfg) -> str:
    """The line that ends ``openpack check_packing``: exact, or the models and layouts that are not."""
    failed = list(dict.fromkeys(f"{r['arch']} ({r['layout']})" for r in results if not r["passed"]))
    verdict = f"NOT exact for {', '.join(failed)}" if failed else "exact"
    layouts = " and ".join(dict.fromkeys(r["layout"] for r in results))
    what = cfg.pretrain or f"{len({r['arch'] for r in results})} architectures"
    return f"packed attention on {device} ({cfg.dtype}): {verdict} across {what} ({layouts} rows)"
