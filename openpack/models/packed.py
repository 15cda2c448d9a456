"""One packed forward of a Hugging Face causal LM, and its per-token log-probs.

The trainer hands over a PackedBatch and gets log-probs back; it never sees
whether rows were packed. The forward always runs with ``use_cache=False``
and explicit ``cu_seqlens`` (see ``openpack.models.attention``), and the LM
head is applied in token chunks by ``openpack.core.logprobs``, so the
``[T, vocab]`` logits never exist at once.
"""

from __future__ import annotations

import torch

from openpack.core.batch import PackedBatch, PaddedBatch
from openpack.core.fused_loss import FusedLoss, fused_segment_loss
from openpack.core.logprobs import token_logprobs
from openpack.models.attention import ATTN_IMPLEMENTATION, PackedCacheError

# Config fields that make logits differ from lm_head(hidden); those models need their own head.
_UNSUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def packed_forward(model, batch: PackedBatch, use_cache: bool = False) -> torch.Tensor:
    """Final hidden states [T, H] of one packed row, each segment attending only to itself."""
    if use_cache:
        raise PackedCacheError(
            "packed_forward(use_cache=True): a KV cache disables transformers' isolation of packed "
            "segments; training forwards always run with use_cache=False"
        )
    implementation = model.config._attn_implementation
    if implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"model uses attn_implementation={implementation!r}; load it through openpack.models "
            f"(attn_implementation={ATTN_IMPLEMENTATION!r}) so packed segments stay isolated"
        )
    output = model.get_decoder()(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        **batch.attention_kwargs(),
    )
    return output.last_hidden_state[0]


def lm_head_weight(model) -> torch.nn.Parameter:
    """The [V, H] output projection, after checking logits are exactly hidden @ weight.T."""
    for name in _UNSUPPORTED_LOGIT_TRANSFORMS:
        if getattr(model.config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} sets config.{name}; openpack's chunked LM head does not apply it")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__} has an LM head bias; openpack's chunked LM head does not apply it")
    return head.weight


def packed_token_logprobs(model, batch: PackedBatch, chunk_tokens: int | None = None,
                          entropy: torch.Tensor | None = None) -> torch.Tensor:
    """log p(label_t) for every position of the row: [T] fp32, 0.0 where there is no label (``entropy``: see
    ``core.logprobs.token_logprobs``)."""
    weight = lm_head_weight(model)
    return token_logprobs(packed_forward(model, batch), weight, batch.labels[0], chunk_tokens, entropy,
                          batch.label_source, batch.label_positions)


def padded_token_logprobs(model, batch: PaddedBatch, chunk_tokens: int | None = None,
                          entropy: torch.Tensor | None = None) -> torch.Tensor:
    """The unpacked baseline: [B * L] fp32 log-probs of right-padded rows (plain SDPA with a padding mask)."""
    return token_logprobs(padded_forward(model, batch), lm_head_weight(model), batch.labels.reshape(-1), chunk_tokens,
                          entropy, positions=batch.label_positions)


def padded_forward(model, batch: PaddedBatch) -> torch.Tensor:
    """Final hidden states [B, L, H] of right-padded rows (plain SDPA with a padding mask)."""
    return model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               use_cache=False).last_hidden_state


def fused_batch_loss(model, batch: PackedBatch | PaddedBatch, fused: FusedLoss,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-segment sums of label log-probs [S]) with the head, loss and gradients fused (``--fused_loss``)."""
    packed = isinstance(batch, PackedBatch)
    hidden = packed_forward(model, batch) if packed else padded_forward(model, batch)
    return fused_segment_loss(hidden, lm_head_weight(model), batch.segment_ids, batch.labels, batch.num_segments,
                              fused, chunk_tokens, batch.label_source if packed else None)


class PackedCausalLM(torch.nn.Module):
    """A causal LM whose forward maps a PackedBatch or PaddedBatch to per-token log-probs.

    This is the module DeepSpeed wraps: ``engine(batch)`` returns log-probs
    laid out like ``batch.labels`` flattened, whichever layout the batch has,
    so a trainer never branches on packing. ``engine(batch, fused=FusedLoss(...))``
    returns (loss, per-segment sums) instead (``core/fused_loss.py``).
    """

    def __init__(self, model, chunk_tokens: int | None = None):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens

    def forward(self, batch: PackedBatch | PaddedBatch, entropy: torch.Tensor | None = None,
                fused: FusedLoss | None = None):
        """``entropy`` (optional, [tokens] fp32) is filled with each labelled position's entropy, a metric."""
        if fused is not None:
            return fused_batch_loss(self.model, batch, fused, self.chunk_tokens)
        if isinstance(batch, PackedBatch):
            return packed_token_logprobs(self.model, batch, self.chunk_tokens, entropy)
        return padded_token_logprobs(self.model, batch, self.chunk_tokens, entropy)
