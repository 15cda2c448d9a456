"""One packed forward of a Hugging Face causal LM, and its per-token log-probs.

The trainer hands over a PackedBatch and gets log-probs back; it never sees
whether rows were packed. The forward always runs with ``use_cache=False``
and explicit ``cu_seqlens`` (see ``openpack.models.attention``), and the LM
head is applied in token chunks by ``openpack.core.logprobs``, so the
``[T, vocab]`` logits never exist at once.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from openpack.core.batch import PackedBatch, PaddedBatch
from openpack.core.fused_loss import FusedLoss, fused_segment_loss
from openpack.core.logprobs import token_logprobs
from openpack.core.router_loss import load_balancing_loss
from openpack.models.attention import ATTN_IMPLEMENTATION, PackedCacheError
from openpack.models.families import LOGIT_TRANSFORMS
from openpack.models.rope import per_sequence_rope


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
    with per_sequence_rope(model, batch):
        output = model.get_decoder()(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            **batch.attention_kwargs(),
            **router_kwargs(model),
        )
    keep_router_loss(model, output)  # a packed row has no padding: every token counts
    return output.last_hidden_state[0]


def lm_head_weight(model) -> torch.nn.Parameter:
    """The [V, H] output projection, after checking logits are hidden @ weight.T (capped by ``final_logit_softcap``)."""
    for name in LOGIT_TRANSFORMS:  # refused from the config before loading too (models.families)
        if getattr(model.config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} sets config.{name}; openpack's chunked LM head does not apply it")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__} has an LM head bias; openpack's chunked LM head does not apply it")
    return head.weight


def final_logit_softcap(model) -> float | None:
    """Gemma-2/3's ``final_logit_softcapping``: logits = cap * tanh(logits / cap); None where the model has none."""
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)


def packed_token_logprobs(model, batch: PackedBatch, chunk_tokens: int | None = None,
                          entropy: torch.Tensor | None = None) -> torch.Tensor:
    """log p(label_t) for every position of the row: [T] fp32, 0.0 where there is no label (``entropy``: see
    ``core.logprobs.token_logprobs``)."""
    weight = lm_head_weight(model)
    return token_logprobs(packed_forward(model, batch), weight, batch.labels[0], chunk_tokens, entropy,
                          batch.label_source, batch.label_positions, final_logit_softcap(model))


def padded_token_logprobs(model, batch: PaddedBatch, chunk_tokens: int | None = None,
                          entropy: torch.Tensor | None = None) -> torch.Tensor:
    """The unpacked baseline: [B * L] fp32 log-probs of right-padded rows (plain SDPA with a padding mask)."""
    return token_logprobs(padded_forward(model, batch), lm_head_weight(model), batch.labels.reshape(-1), chunk_tokens,
                          entropy, positions=batch.label_positions, softcap=final_logit_softcap(model))


def padded_forward(model, batch: PaddedBatch) -> torch.Tensor:
    """Final hidden states [B, L, H] of right-padded rows (plain SDPA with a padding mask)."""
    with per_sequence_rope(model, batch):
        output = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                     use_cache=False, **router_kwargs(model))
    keep_router_loss(model, output, batch.attention_mask)
    return output.last_hidden_state


def fused_batch_loss(model, batch: PackedBatch | PaddedBatch, fused: FusedLoss,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-segment sums of label log-probs [S]) with the head, loss and gradients fused (``--fused_loss``)."""
    packed = isinstance(batch, PackedBatch)
    hidden = packed_forward(model, batch) if packed else padded_forward(model, batch)
    return fused_segment_loss(hidden, lm_head_weight(model), batch.segment_ids, batch.labels, batch.num_segments,
                              fused, chunk_tokens, batch.label_source if packed else None, final_logit_softcap(model))


class PackedCausalLM(torch.nn.Module):
    """A causal LM whose forward maps a PackedBatch or PaddedBatch to per-token log-probs.

    This is the module DeepSpeed wraps: ``engine(batch)`` returns log-probs
    laid out like ``batch.labels`` flattened, whichever layout the batch has,
    so a trainer never branches on packing. ``engine(batch, fused=FusedLoss(...))``
    returns (loss, per-segment sums) instead (``core/fused_loss.py``). An MoE
    model's forward with gradients on also leaves its router load-balancing
    loss in ``router_aux_loss`` for the trainer (``trainers/router_aux.py``).
    """

    def __init__(self, model, chunk_tokens: int | None = None):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.router_aux_loss: torch.Tensor | None = None  # the last forward's (0-dim fp32), None without one

    @property
    def router(self) -> RouterLoss | None:
        return router_loss(self.model.config)

    def forward(self, batch: PackedBatch | PaddedBatch, entropy: torch.Tensor | None = None,
                fused: FusedLoss | None = None):
        """``entropy`` (optional, [tokens] fp32) is filled with each labelled position's entropy, a metric."""
        with self._router_aux_loss():
            if fused is not None:
                return fused_batch_loss(self.model, batch, fused, self.chunk_tokens)
            if isinstance(batch, PackedBatch):
                return packed_token_logprobs(self.model, batch, self.chunk_tokens, entropy)
            return padded_token_logprobs(self.model, batch, self.chunk_tokens, entropy)

    @contextmanager
    def _router_aux_loss(self):
        """Collect the forward's router loss into ``router_aux_loss``: only an MoE model's, only with gradients on
        (the reference and old-policy passes run without, and never ask the decoder for router logits)."""
        losses = [] if torch.is_grad_enabled() and self.router is not None else None
        token = _router_losses.set(losses)
        try:
            yield
        finally:
            _router_losses.reset(token)
        self.router_aux_loss = sum(losses) if losses else None


@dataclass(frozen=True)
class RouterLoss:
    """An MoE model's router load-balancing loss: ``coef`` x ``core.router_loss.load_balancing_loss`` trains."""

    coef: float
    num_experts: int
    top_k: int


def router_loss(config) -> RouterLoss | None:
    """The load-balancing loss an MoE config trains with, as transformers' MoE causal LMs read it
    (``router_aux_loss_coef`` > 0, ``num_experts`` or Mixtral's ``num_local_experts``, ``num_experts_per_tok``);
    None for a dense model or a coefficient of 0. Unlike TRL, it does not wait for the config's
    ``output_router_logits`` (False by default), which would leave MoE models training without it."""
    config = config.get_text_config()
    coef = getattr(config, "router_aux_loss_coef", None) or 0.0
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if coef <= 0 or not experts or not top_k:
        return None
    return RouterLoss(float(coef), int(experts), int(top_k))


# The router losses of the PackedCausalLM forward under way; None while no forward collects them.
_router_losses: ContextVar[list | None] = ContextVar("openpack_router_losses", default=None)


def router_kwargs(model) -> dict:
    """What a decoder call adds for the router loss: for an MoE model ``output_router_logits``, True only while a
    ``PackedCausalLM`` forward collects (False overrides a config that sets it); nothing for a dense model."""
    if router_loss(model.config) is None:
        return {}
    return {"output_router_logits": _router_losses.get() is not None}


def keep_router_loss(model, output, attention_mask: torch.Tensor | None = None) -> None:
    """Hand the load-balancing loss of a decoder ``output`` to the collecting forward (``router_kwargs``), over real
    tokens: those of ``attention_mask`` [B, L], or every token (a packed row)."""
    losses, router_logits = _router_losses.get(), getattr(output, "router_logits", None)
    if losses is None or not router_logits:
        return
    spec = router_loss(model.config)
    losses.append(load_balancing_loss(router_logits, spec.num_experts, spec.top_k, attention_mask))
