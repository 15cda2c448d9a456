"""Per-token and per-segment log-probs from hidden states, in token chunks.

A packed row of T tokens through a vocab of V has T x V logits; at T = 8192
and V = 128k that is 4 GiB in fp32, more than the model's activations. Here
logits exist only for ``chunk_tokens`` rows at a time, in the forward and
again (recomputed) in the backward, and softmax and logsumexp work in the
chunk's own buffer, so one chunk of ``chunk_tokens x V x 4`` bytes (256 MiB
by default) is the only vocab-sized tensor alive at a time, besides the
head's fp32 gradient, whatever T is. ``benchmarks/logprob_memory.py``
measures 0.6-0.7 GiB of extra resident memory at vocab 32k-152k for an
8192-token row, against 3-14 GiB for full logits.
Only tokens that carry a label are projected at all: a DPO prompt costs no
vocab projection.

``token_logprobs`` gives log p(label_t | tokens <= t) for each position;
``segment_logprobs`` sums and averages them per segment of a PackedBatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openpack.core.batch import CHOSEN, REJECTED, PackedBatch, label_positions

DEFAULT_CHUNK_ELEMENTS = 1 << 26  # logits per chunk: 64M floats = 256 MiB in fp32


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, DEFAULT_CHUNK_ELEMENTS // vocab_size)


class _ChunkedLabelLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[label] and (``with_entropy``) each row's entropy, chunk by chunk; backward
    recomputes each chunk.

    d logp_t / d logits_t = onehot(label_t) - softmax(logits_t), so the
    backward needs only the chunk's logits, never the whole [N, V] block. With a
    ``softcap`` the logits are capped (``chunk_logits``) and the gradient is scaled
    by the cap's slope, one more chunk-sized buffer in the backward. The entropy
    H_t = -sum_v p_v log p_v has d H_t / d logits_t = -p (log p + H_t); its part of the
    backward (two more chunk-sized buffers) runs only when the entropy is trained on
    (an entropy bonus); as a metric it costs no backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, with_entropy=False, softcap=None):
        ctx.set_materialize_grads(False)  # no entropy gradient unless a loss uses the entropy
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits, _ = chunk_logits(hidden[start:end], weight, softcap)
            picked = logits.gather(1, labels[start:end, None])[:, 0]
            if with_entropy:  # H = lse - sum(p * logits), from the chunk already in memory
                entropy[start:end] = _entropy(logits)
            out[start:end] = picked - _logsumexp_(logits)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens, ctx.softcap = chunk_tokens, softcap
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        if grad_out is None:
            grad_out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            logits, slope = chunk_logits(hidden[start:end], weight, ctx.softcap, slope=True)
            if grad_entropy is None:
                grad = _softmax_(logits).mul_(-grad_out[start:end, None])  # fp32, in the logits' buffer
            else:
                grad = _logprobs_and_entropy_grad(logits, grad_out[start:end], grad_entropy[start:end])
            grad.scatter_add_(1, labels[start:end, None], grad_out[start:end, None])
            if slope is not None:
                grad.mul_(slope)
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, hidden[start:end].float())  # no [V, H] temporary per chunk
            if grad_hidden is not None:
                grad_hidden[start:end] = grad.to(hidden.dtype) @ weight
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None = None,
                 slope: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits [N, V] of hidden [N, H] through the head [V, H], and their slope d logits / d (hidden @ weight.T).

    ``softcap`` (Gemma-2/3's ``final_logit_softcapping``) caps them to ``softcap * tanh(logits / softcap)`` in place;
    with ``slope`` the slope ``1 - tanh^2`` is a second chunk-sized buffer. No cap, or no ``slope``: the slope is None.
    """
    logits = (hidden @ weight.T).float()
    if softcap is None:
        return logits, None
    tanh = logits.div_(softcap).tanh_()
    if not slope:
        return tanh.mul_(softcap), None
    return tanh * softcap, tanh.square_().neg_().add_(1)


def _logprobs_and_entropy_grad(logits: torch.Tensor, grad_out: torch.Tensor, grad_entropy: torch.Tensor):
    """d/d logits of sum_t (grad_out_t logp_t + grad_entropy_t H_t), less the one-hot part of logp's (added by the
    caller): -p grad_out - p (log p + H) grad_entropy, row by row."""
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(dim=-1, keepdim=True)
    return -p * (grad_out[:, None] + (log_p + entropy) * grad_entropy[:, None])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise entropy of softmax(logits) (two chunk-sized temporaries; ``logits`` left as it was)."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_z = shifted.exp().sum(dim=-1).log()
    probs = (shifted - log_z[:, None]).exp_()
    return log_z - (probs * shifted).sum(dim=-1)


def _logsumexp_(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp that overwrites ``logits`` instead of allocating another chunk."""
    peak = logits.amax(dim=-1, keepdim=True)
    return logits.sub_(peak).exp_().sum(dim=-1).log_().add_(peak[:, 0])


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax in ``logits``' own buffer."""
    logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(dim=-1, keepdim=True))


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    entropy: torch.Tensor | None = None,
    sources: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Log-prob of each label under ``softmax(logits)``, logits = ``hidden @ weight.T`` (capped with ``softcap``).

    hidden: [T, H]; weight: [V, H] (the LM head); labels: [T] with
    IGNORE_INDEX where there is nothing to predict. Returns [T] fp32, 0.0 at
    ignored positions. ``entropy`` ([T] fp32, optional) is filled with the
    entropy of each labelled position's distribution (0.0 elsewhere), computed
    from the logits chunk already in memory (no second projection); it carries
    its gradient, which costs a backward only where a loss uses it. ``sources`` ([T] int64, prefix sharing: ``PackedBatch.label_source``) names the
    hidden row each label is predicted from; None: its own row. ``positions`` ([N] int64, optional:
    ``PackedBatch.label_positions``) are where the labels are, found on the host; None: found here.
    ``softcap``: the model's ``final_logit_softcapping`` (Gemma-2/3), None for a plain head.
    """
    labels = labels.reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if positions is None:
        positions = label_positions(labels)
    rows = positions if sources is None else sources.reshape(-1)[positions]
    picked, picked_entropy = _ChunkedLabelLogprobs.apply(hidden[rows], weight, labels[positions], chunk_tokens,
                                                         entropy is not None, softcap)
    if entropy is not None:  # the caller's buffer, now with the entropy's gradient (an entropy bonus uses it)
        entropy.zero_().index_put_((positions,), picked_entropy)
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
    return out.index_put((positions,), picked)


@dataclass
class SegmentLogprobs:
    """Per-segment results, indexed like ``PackedBatch.sample_index``: each [S]."""

    sum: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / self.count.clamp(min=1)


def segment_logprobs(batch: PackedBatch, per_token: torch.Tensor) -> SegmentLogprobs:
    """Sum the per-token log-probs ([T]) of each segment and count its label tokens."""
    segment_ids = batch.segment_ids.to(per_token.device)
    mask = batch.loss_mask.reshape(-1).to(per_token.device)
    zeros = torch.zeros(batch.num_segments, dtype=per_token.dtype, device=per_token.device)
    return SegmentLogprobs(sum=zeros.index_add(0, segment_ids, per_token * mask),
                           count=segment_label_counts(batch, per_token.device))


def segment_label_counts(batch, device=None) -> torch.Tensor:
    """Label tokens of each segment: [S] int64."""
    mask = batch.loss_mask.reshape(-1).to(device, torch.int64)
    return torch.zeros(batch.num_segments, dtype=torch.int64, device=mask.device).index_add(
        0, batch.segment_ids.to(mask.device), mask)


def pair_segments(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sample ids, chosen segment, rejected segment) of a batch of pairs, each [P], ordered by sample id.

    Found through the segment table (sample index and role), never by
    position or batch halves (the mix-up of OpenRLHF #294).
    """
    segments = torch.arange(batch.num_segments, device=batch.role.device)
    chosen_ids, chosen = _sorted_by_sample(batch.sample_index, segments, batch.role == CHOSEN)
    rejected_ids, rejected = _sorted_by_sample(batch.sample_index, segments, batch.role == REJECTED)
    if not torch.equal(chosen_ids, rejected_ids):
        raise ValueError(f"pairs are split across micro-batches: chosen {chosen_ids.tolist()} vs rejected {rejected_ids.tolist()}")
    return chosen_ids, chosen, rejected


def _sorted_by_sample(sample_index, values, mask):
    ids = sample_index[mask]
    order = torch.argsort(ids)
    return ids[order], values[mask][order]
