"""``--fused_loss``: the LM head, the loss and their gradients in one pass, each chunk's logits computed once.

The chunked log-probs (``core/logprobs.py``) compute every chunk of logits twice: in the forward, and again in the
backward, since the gradient a token's log-prob receives is only known after the loss. That is four vocab-sized
matmuls per token (logits, logits again, grad of hidden, grad of weight) instead of three. When the loss is a
function of per-segment sums of label log-probs, and the gradient for a segment's sum needs only the sums of its own
group (the two responses of a DPO pair; nothing at all for SFT's linear NLL), the gradient of a chunk that holds whole
groups is known as soon as its logits are::

    d loss / d logits_t = d loss / d sum[segment(t)] * (onehot(label_t) - softmax(logits_t))

so the forward computes the logits once, the loss, and the gradients of the hidden states and the head, and the
backward only scales them by the incoming gradient (Liger-Kernel's fused linear losses make the same trade).
The cost: a chunk holds whole groups, so a DPO chunk is at least one pair's label tokens whatever
``chunk_tokens`` says, and the head's gradient is held from the forward to the backward. Online RL is not covered:
its token-level losses and entropy bonus need more than a per-segment sum. A softcapped head (Gemma-2/3's
``final_logit_softcapping``) multiplies grad_logits by the cap's slope, one more chunk-sized buffer.

    chunk (whole pairs)     logits = hidden @ W.T (once) -> log p(label) -> segment sums -> d loss / d sums
                            grad_logits -> grad_hidden = grad_logits @ W,  grad_W += grad_logits.T @ hidden
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from openpack.core.batch import host_to_device, label_positions
from openpack.core.logprobs import chunk_logits, default_chunk_tokens


@dataclass
class FusedLoss:
    """What ``PackedCausalLM.forward(batch, fused=...)`` needs to return a loss instead of log-probs.

    ``loss_of_sums`` maps per-segment sums of label log-probs ([S] fp32) to a scalar loss; the gradient for a
    segment's sum must depend only on the sums of its own group. ``labels`` and ``groups`` ([T], the batch's labels
    flattened and each token's group, e.g. its pair's sample index; None: the loss is linear in the sums, any cut
    will do) stay on the CPU, so chunks are planned without a device sync (``plan_fused_chunks``).
    """

    loss_of_sums: Callable[[torch.Tensor], torch.Tensor]
    labels: torch.Tensor
    groups: torch.Tensor | None = None


def plan_fused_chunks(labels: torch.Tensor, group_of_token: torch.Tensor | None,
                      chunk_tokens: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Labelled positions of ``labels`` ([T], on the CPU: no device sync) grouped, and (start, end) chunks of them.

    ``group_of_token`` [T] (e.g. each token's pair): positions are ordered by group, then by position, and a chunk
    ends only where a group does, so it holds at least one whole group and otherwise up to ``chunk_tokens``
    positions. None: the loss is linear in the sums, any cut is fine, and chunks are ``chunk_tokens`` long.
    """
    positions = label_positions(labels)
    if group_of_token is None:
        n = positions.numel()
        return positions, [(lo, min(lo + chunk_tokens, n)) for lo in range(0, n, chunk_tokens)]
    ordered = torch.sort(group_of_token.reshape(-1)[positions], stable=True)
    positions = positions[ordered.indices]
    _, sizes = torch.unique_consecutive(ordered.values, return_counts=True)
    chunks, start, end = [], 0, 0
    for size in sizes.tolist():
        if end > start and end - start + size > chunk_tokens:
            chunks.append((start, end))
            start = end
        end += size
    if end > start:
        chunks.append((start, end))
    return positions, chunks


class _FusedSegmentLoss(torch.autograd.Function):
    """(loss, segment sums) from hidden [N, H], the head [V, H] and labels [N]; gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, segments, num_segments, chunks, loss_of_sums, softcap=None):
        sums = torch.zeros(num_segments, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        needs_grad = grad_hidden is not None or grad_weight is not None
        for start, end in chunks:
            rows, chunk_labels, chunk_segments = hidden[start:end], labels[start:end, None], segments[start:end]
            logits, slope = chunk_logits(rows, weight, softcap, slope=needs_grad)
            picked = logits.gather(1, chunk_labels)[:, 0]
            peak = logits.amax(dim=-1, keepdim=True)
            total = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True)
            sums.index_add_(0, chunk_segments, picked - peak[:, 0] - total[:, 0].log())
            if not needs_grad:
                continue
            # The chunk's groups are whole, so their sums are final and so is the loss's gradient for them.
            with torch.enable_grad():
                leaf = sums.detach().requires_grad_()
                (grad_sums,) = torch.autograd.grad(loss_of_sums(leaf), leaf)
            g = grad_sums[chunk_segments]
            grad = logits.div_(total).mul_(-g[:, None])  # -g * softmax, in the logits' buffer
            grad.scatter_add_(1, chunk_labels, g[:, None])
            if slope is not None:  # through the softcap: d capped / d logits = 1 - tanh^2
                grad.mul_(slope)
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, rows.float())
            if grad_hidden is not None:
                grad_hidden[start:end] = grad.to(hidden.dtype) @ weight
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(sums)
        return loss_of_sums(sums).detach(), sums

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)  # once_differentiable: scaled in place
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_segment_loss(hidden: torch.Tensor, weight: torch.Tensor, segment_ids: torch.Tensor, labels: torch.Tensor,
                       num_segments: int, fused: FusedLoss, chunk_tokens: int | None = None,
                       sources: torch.Tensor | None = None,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-segment sums of label log-probs [S], no gradient) of one batch; the loss backpropagates.

    hidden [T, H] (any leading shape), weight [V, H], segment_ids and labels [T] flattened like the hidden rows;
    ``chunk_tokens``: the chunk budget (default: 2^26 logits, as the chunked log-probs); ``sources`` (prefix
    sharing, ``PackedBatch.label_source``) names the hidden row each label is predicted from; ``softcap``: the
    model's ``final_logit_softcapping`` (logits capped to ``softcap * tanh(logits / softcap)``), None for a plain head.
    """
    positions, chunks = plan_fused_chunks(fused.labels, fused.groups,
                                          chunk_tokens or default_chunk_tokens(weight.shape[0]))
    positions = host_to_device(positions, hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    rows = positions if sources is None else sources.reshape(-1)[positions]
    return _FusedSegmentLoss.apply(hidden[rows], weight, labels.reshape(-1)[positions],
                                   segment_ids.reshape(-1)[positions], num_segments, chunks, fused.loss_of_sums,
                                   softcap)
