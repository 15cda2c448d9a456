"""Segment-isolated attention for packed rows, registered with transformers.

``ATTN_IMPLEMENTATION`` ("openpack_varlen") is one attention function that
every supported Hugging Face decoder calls through ``AttentionInterface``.
With ``cu_seq_lens_q`` in its keyword arguments (a packed forward; see
``PackedBatch.attention_kwargs``) it attends inside each segment only, on the
first backend that is available:

1. ``flash_attn``: ``flash_attn.flash_attn_varlen_func`` (flash-attn installed, CUDA);
2. ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, no flash-attn);
3. ``sdpa``: scaled-dot-product attention per segment (CPU; also the reference).

``set_attention_backend`` overrides the choice; the choice is logged once per
backend. Without ``cu_seq_lens_q`` (generation, evaluation, padded batches) it
is plain transformers SDPA, so the same model object also generates.

Attention logit softcapping (Gemma-2's ``attn_logit_softcapping``, the
``softcap`` keyword): flash-attn >= 2.6 applies it in its kernel; SDPA has
none, so there the scores are materialised and capped explicitly, [n, H, L, L]
per length group (the CPU reference; slower than SDPA); torch's varlen_attn has
none, so "auto" does not pick it for a softcapped model and
``--attn_backend torch_varlen`` refuses one.

Prefix sharing (``shared_prefix`` in the keyword arguments; see
``core.batch.SharedPrefix``): a pair laid out prompt | chosen | rejected runs
as two varlen calls on every backend. First, every row but the rejected ones,
with prompt + chosen as one causal segment; then the rejected rows over the
keys of their prompt and themselves, causal aligned to the bottom-right
corner, so a rejected token sees the whole prompt and the rejected tokens up
to itself, never chosen. Keys are gathered so that their index in that call
equals their position, which makes a sliding window apply in position space.
flash-attn and torch varlen align ``causal`` bottom-right when a query block
is shorter than its keys (flash-attn >= 2.1; PyTorch's FlashAttention-2);
those two paths follow the libraries' public APIs and have not run here (no
CUDA). On CPU the second call is SDPA per response with an explicit
bottom-right mask; ``models.verify.shared_prefix_mask`` is the block-mask
reference it is tested against.

Context parallelism (``context_shard`` in the keyword arguments; see
``core.context_parallel``): this rank holds pieces of the row's documents.
The keys and values of the whole row are all-gathered from the context group
(``models.context_parallel``), then each piece is a block of queries over its
document's keys from position 0 (or the window before it) up to its own last
token: the cross call above, causal aligned to the bottom-right corner, so a
piece that continues a document held by another rank sees exactly that
document's earlier tokens. Tested on CPU (SDPA, gloo) only; there a piece
needs no [queries, keys] mask (``_PrefixThenCausal``), so a rank's memory
stays O(its tokens + the row's K/V), as on the varlen kernels.

Boundaries are never guessed from ``position_ids``. A packed forward with a KV
cache is refused: transformers' own packed-sequence detection switches off
when a cache is present (measured 0.50 max logit error on a tiny Llama).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging

import torch
import torch.nn.functional as F

from openpack.core.context_parallel import key_rows
from openpack.models.context_parallel import all_gather_rows

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "openpack_varlen"
BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa")

_requested = "auto"
_logged: set[str] = set()


class PackedCacheError(RuntimeError):
    """A packed forward was asked to use a KV cache."""


def set_attention_backend(name: str) -> None:
    """Force a backend for packed forwards (``--attn_backend``); "auto" picks by device."""
    global _requested
    if name not in BACKENDS:
        raise ValueError(f"--attn_backend must be one of {BACKENDS}, got {name!r}")
    reason = unavailable_backend(name)
    if reason:
        raise ValueError(reason)
    _requested = name


def unavailable_backend(name: str) -> str | None:
    """Why ``--attn_backend name`` cannot run in this environment (one line naming the fix), or None. The driver
    asks before any worker starts (``config.sections.check_attention_backend``), so a missing flash-attn is one
    line, not an ImportError relayed by Ray from every rank."""
    if name == "flash_attn" and not _flash_attn_installed():
        return ("--attn_backend flash_attn: flash-attn is not installed here (pip install openpack[gpu], on a "
                "machine with a CUDA GPU); or use --attn_backend auto, which picks torch_varlen or sdpa")
    if name == "torch_varlen" and not _torch_varlen_available():
        return (f"--attn_backend torch_varlen needs torch >= 2.10 with torch.nn.attention.varlen (torch "
                f"{torch.__version__} here); use --attn_backend auto or sdpa")
    return None


def resolve_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16, softcap: bool = False) -> str:
    """The backend a packed forward on ``device`` in ``dtype`` uses now (``softcap``: attention logit softcapping).

    The fused varlen kernels run in fp16/bf16 only, so "auto" keeps fp32 on SDPA; torch's ``varlen_attn`` has no
    softcap, so "auto" keeps a softcapped model (Gemma-2) off it.
    """
    if _requested != "auto":
        return _requested
    fused = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if fused and _flash_attn_installed():
        return "flash_attn"
    if fused and _torch_varlen_available() and not softcap:
        return "torch_varlen"
    return "sdpa"


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The ``AttentionInterface`` entry: query [1, Hq, T, D], key/value [1, Hkv, T, D]."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return _unpacked_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("use_cache") or key.shape[2] != query.shape[2]:
        raise PackedCacheError(
            "packed forward with a KV cache: transformers stops isolating packed segments when a cache "
            "is used; pass use_cache=False (openpack.models.packed_forward does)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed rows have batch size 1, got query of shape {tuple(query.shape)}")
    softcap = kwargs.get("softcap")  # Gemma-2's attn_logit_softcapping: scores = softcap * tanh(scores / softcap)
    backend = resolve_backend(query.device, query.dtype, softcap is not None)
    if backend not in _logged:
        _logged.add(backend)
        logger.info("packed attention backend: %s (%s, %s%s)", backend, query.device, query.dtype,
                    ", softcapped attention" if softcap is not None else "")
    window = kwargs.get("sliding_window")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    groups = query.shape[1] // key.shape[1]  # query heads per KV head (GPT-NeoX's attention names no such field)
    shard = kwargs.get("context_shard")
    if shard is not None:
        out = _context_parallel_attention(backend, q, k, v, shard, scaling, dropout, window, groups, softcap)
        return out[None], None
    shared = kwargs.get("shared_prefix")
    if shared is not None:
        out = _shared_prefix_attention(backend, q, k, v, shared, scaling, dropout, window, groups, softcap)
        return out[None], None
    out = _KERNELS[backend](q, k, v, cu_seqlens, int(kwargs["max_length_q"]), scaling, dropout, window, groups,
                            softcap)
    return out[None], None  # [1, T, Hq, D], as transformers' backends return


def _shared_prefix_attention(backend, q, k, v, shared, scale, dropout, window, groups, softcap=None):
    """The two passes of ``core.batch.SharedPrefix``: main segments, then later responses over prompt + self."""
    rows = shared.main_rows
    main = _KERNELS[backend](_gather(q, rows), _gather(k, rows), _gather(v, rows),
                             shared.main_cu_seqlens, shared.main_max_seqlen, scale, dropout, window, groups, softcap)
    if shared.cross_rows.numel() == 0:
        return _gather(main, shared.restore)
    if backend == "sdpa":
        cross = _sdpa_grouped_cross(q, k, v, shared, scale, dropout, window, groups, softcap)
        return _gather(torch.cat([main, cross]), shared.restore)
    keys = shared.cross_keys
    cross = _CROSS_KERNELS[backend](
        _gather(q, shared.cross_rows), _gather(k, keys), _gather(v, keys),
        shared.cross_cu_seqlens_q, shared.cross_cu_seqlens_k, shared.cross_max_seqlen_q, shared.cross_max_seqlen_k,
        scale, dropout, window, groups, softcap,
    )
    return _gather(torch.cat([main, cross]), shared.restore)


def _context_parallel_attention(backend, q, k, v, shard, scale, dropout, window, groups, softcap=None):
    """This rank's queries over their documents' keys, gathered from the context group: one all-gather of K and V
    together, then one cross call with each local piece at the bottom-right corner of its keys."""
    gathered = all_gather_rows(torch.cat([k, v], dim=1), shard)  # [N x max_local_tokens, 2 Hkv, D]
    rows, cu_k, max_k = key_rows(shard, window)
    keys, values = _gather(gathered, rows).split(k.shape[1], dim=1)
    return _CROSS_KERNELS[backend](q, keys, values, shard.cu_seqlens_q, cu_k, shard.max_seqlen_q, max_k, scale,
                                   dropout, window, groups, softcap)


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward scatters with ``index_put_(accumulate=True)`` on CPU and
    ``index_add_`` on CUDA.

    ``index_select``'s own backward runs ``index_add_``, which on CPU (torch 2.13) took ~0.1 s per call for a
    few thousand elements on a busy 2-core machine (``index_put_``: 10 us), making a prefix-shared step 40x
    slower than an unshared one. On CUDA it is the other way round: ``index_put_(accumulate=True)`` sorts its
    indices, ~360 us of host time per call on an H100 (2026-11-26), 62 ms of a 0.5B model's prefix-shared pass
    (168 calls), where ``index_add_`` is one atomic kernel. Only ``cross_keys`` repeats rows (a prompt's keys,
    once per later response), so only those rows' gradients see atomics' order, as flash-attn's own backward.
    """

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        zeros = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        if grad.is_cuda:
            return zeros.index_add_(0, index, grad), None
        return zeros.index_put_((index,), grad, accumulate=True), None


_gather = _Gather.apply


def _flash_attn_cross(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout, window, _groups, softcap=None):
    from flash_attn import flash_attn_varlen_func

    # flash-attn handles GQA natively; window (left, right) keeps keys in [i - left, i]. With fewer queries than
    # keys, flash-attn >= 2.1 aligns causal (and the window) to the bottom-right corner.
    window_size = (window - 1, 0) if window else (-1, -1)
    capped = {"softcap": softcap} if softcap is not None else {}  # flash-attn >= 2.6; older ones lack the argument
    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k,
        dropout_p=dropout, softmax_scale=scale, causal=True, window_size=window_size, **capped,
    )


def _torch_varlen_cross(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout, window, groups, softcap=None):
    # FlashAttention-2 underneath: causal and the window align to the bottom-right corner, as in flash-attn.
    return _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout, window, groups, softcap)


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout, window, groups, softcap=None):
    """Causal ``varlen_attn`` across the signatures PyTorch has shipped.

    torch 2.10 takes ``is_causal`` and neither ``scale`` nor ``window_size``;
    2.11 adds ``scale`` and ``window_size`` (``(-1, 0)`` is causal); later ones
    add ``enable_gqa``. Without it, grouped KV heads are repeated (query head h
    reads KV head h // groups, as transformers' ``repeat_kv``): the H200 run of
    2026-11-26 (torch 2.11) refused ``enable_gqa``.
    """
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise ValueError("torch_varlen attention has no dropout; use flash_attn or set attention_dropout=0")
    if softcap is not None:
        raise ValueError("--attn_backend torch_varlen: torch's varlen_attn has no attention logit softcapping "
                         "(the model's attn_logit_softcapping); use --attn_backend flash_attn (flash-attn >= 2.6) "
                         "or --attn_backend sdpa")
    params = _varlen_parameters()
    kwargs = {}
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    if "window_size" in params:
        # (-1, 0) is plain causal; (W - 1, 0) a causal sliding window of W keys.
        kwargs["window_size"] = (window - 1, 0) if window else (-1, 0)
    elif window:
        raise ValueError(f"torch {torch.__version__}'s varlen_attn has no sliding window; use flash_attn, "
                         "--attn_backend sdpa, or torch >= 2.11")
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None:
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel divides by sqrt(head_dim)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _sdpa_cross(q, k, v, cu_q, cu_k, _max_q, _max_k, scale, dropout, window, groups, softcap=None):
    """SDPA of each response (queries) over its prompt's keys and its own, with a bottom-right causal mask.

    Responses of the same (query, key) lengths share one batched call, as ``_sdpa_kernel`` batches segments of
    one length: an RL group's later completions of one length after one prompt are one call, not n - 1.
    """
    q_starts, k_starts = cu_q[:-1].long(), cu_k[:-1].long()
    q_lengths, k_lengths = cu_q[1:].long() - q_starts, cu_k[1:].long() - k_starts
    order, outputs = [], []
    for queries, keys in torch.stack([q_lengths, k_lengths], 1).unique(dim=0).tolist():
        same = (q_lengths == queries) & (k_lengths == keys)
        q_index = q_starts[same][:, None] + torch.arange(queries, device=q.device)  # [n, queries]
        if q_index.shape[0] == 1:  # a shape of its own: slices, no gather (and no scatter in the backward)
            q0, k0 = int(q_index[0, 0]), int(k_starts[same][0])
            qs = q[q0:q0 + queries][None].transpose(1, 2)
            ks, vs = (x[k0:k0 + keys][None].transpose(1, 2) for x in (k, v))
        else:
            k_index = k_starts[same][:, None] + torch.arange(keys, device=q.device)  # [n, keys]
            qs = q[q_index].transpose(1, 2)  # [n, H, queries, D]
            ks, vs = (x[k_index].transpose(1, 2) for x in (k, v))
        if _maskless_cross(qs, keys, window, dropout, softcap):
            attended = _bottom_right_causal(qs, ks, vs, scale, groups)
        else:
            mask = _bottom_right_mask(queries, keys, window, q.device)
            if softcap is not None:  # SDPA has no softcap
                attended = _softcapped_attention(qs, ks, vs, mask, scale, dropout, softcap)
            else:
                attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout,
                                                          scale=scale, enable_gqa=groups > 1)
        outputs.append(attended.transpose(1, 2).reshape(-1, *attended.shape[1:2], attended.shape[-1]))
        order.append(q_index.reshape(-1))
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=q.device)
    return torch.cat(outputs).index_select(0, inverse)


def _maskless_cross(qs: torch.Tensor, keys: int, window: int | None, dropout: float, softcap) -> bool:
    """Whether ``_sdpa_cross`` can attend bottom-right causal without a [queries, keys] mask: on CPU, with no
    window shorter than the keys, no dropout and no softcap (``_bottom_right_causal``)."""
    return (qs.device.type == "cpu" and not dropout and softcap is None and (not window or window >= keys)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _bottom_right_causal(qs, ks, vs, scale, groups):
    """Causal attention of queries [n, Hq, Q, D], the last Q of keys [n, Hkv, K, D], aligned bottom-right, without
    a mask: one causal SDPA call when Q == K, else ``_PrefixThenCausal``."""
    if qs.shape[-2] == ks.shape[-2]:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=groups > 1)
    return _PrefixThenCausal.apply(qs, ks, vs, scale)


class _PrefixThenCausal(torch.autograd.Function):
    """CPU bottom-right causal attention with O(K) memory: the queries over the P = K - Q keys before them (all
    visible, no mask), then over their own Q keys (causal, square), the two merged by their log-sum-exps; in the
    backward each part's gradients from the merged output and log-sum-exp, as ring attention merges its blocks.

    SDPA with the explicit [Q, K] mask (what this replaces) held about 13 bytes per mask element from the forward to
    the backward on CPU (torch 2.13: a 4096 x 4096 mask, 218 MiB), so a rank of a context group holding the middle
    of a 16k-token document kept 1.3 GB per layer, more than the whole unsplit row's activations. torch's CPU flash
    kernel (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA itself dispatches to on CPU) returns the
    log-sum-exp and takes grouped KV heads as they are.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale):
        prefix = k.shape[-2] - q.shape[-2]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        seen, seen_lse = flash(q, k[..., :prefix, :], v[..., :prefix, :], 0.0, False, scale=scale)
        own, own_lse = flash(q, k[..., prefix:, :], v[..., prefix:, :], 0.0, True, scale=scale)
        lse = torch.logaddexp(seen_lse, own_lse)
        out = seen * (seen_lse - lse).exp()[..., None] + own * (own_lse - lse).exp()[..., None]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.prefix = scale, prefix
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad, prefix = grad.contiguous(), ctx.prefix
        dq_seen, dk_seen, dv_seen = backward(grad, q, k[..., :prefix, :], v[..., :prefix, :], out, lse, 0.0, False,
                                             scale=ctx.scale)
        dq_own, dk_own, dv_own = backward(grad, q, k[..., prefix:, :], v[..., prefix:, :], out, lse, 0.0, True,
                                          scale=ctx.scale)
        return dq_seen + dq_own, torch.cat([dk_seen, dk_own], -2), torch.cat([dv_seen, dv_own], -2), None


def _sdpa_grouped_cross(q, k, v, shared, scale, dropout, window, groups, softcap=None):
    """SDPA's cross pass: the later responses after one prompt as one call, their queries over the prompt's keys
    and all of their own (each key row gathered once), a mask letting each response see the prompt and its own
    earlier tokens. [X, Hq, D] in ``cross_rows`` order.

    The varlen kernels take each response with its own copy of the prompt's keys (``cross_keys``). On SDPA that
    copy, twice over (the gather, then the batch of equal shapes), held (n - 1) x prompt x 2 x kv width per group and
    layer until the backward: on 320-token prompts x 8 completions of 32 tokens (a 6-layer 9.8M Llama, rows of
    1728 tokens), prefix sharing's pass peaked 40 MiB above the unshared layout's, where this one peaks 84 MiB
    below it (issue 42).
    """
    cu_q, cu_k = shared.cross_cu_seqlens_q.long(), shared.cross_cu_seqlens_k.long()
    q_lengths, k_lengths = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    prompt_lengths = k_lengths - q_lengths
    first_key = shared.cross_keys[cu_k[:-1]]  # the first prompt row: the response's group
    order, outputs = [], []
    for group in first_key.unique().tolist():
        members = (first_key == group).nonzero().flatten()
        prompt = int(prompt_lengths[members[0]])
        starts, lengths = cu_q[members], q_lengths[members]
        positions = torch.cat([torch.arange(int(s), int(s) + int(n), device=q.device)
                               for s, n in zip(starts.tolist(), lengths.tolist())])  # cross positions
        segment = torch.repeat_interleave(torch.arange(len(members), device=q.device), lengths)
        offset = positions - torch.repeat_interleave(starts, lengths)  # each query's place in its response
        prompt_rows = shared.cross_keys[int(cu_k[members[0]]):int(cu_k[members[0]]) + prompt]
        rows = shared.cross_rows[positions]
        key_rows = torch.cat([prompt_rows, rows])
        mask = _shared_cross_mask(segment, offset, prompt, window)
        qs = _gather(q, rows)[None].transpose(1, 2)  # [1, Hq, Q, D]
        ks, vs = (_gather(x, key_rows)[None].transpose(1, 2) for x in (k, v))
        if softcap is not None:
            attended = _softcapped_attention(qs, ks, vs, mask, scale, dropout, softcap)
        else:
            attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scale,
                                                      enable_gqa=groups > 1)
        outputs.append(attended[0].transpose(0, 1))
        order.append(positions)
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=q.device)
    return torch.cat(outputs).index_select(0, inverse)


def _shared_cross_mask(segment: torch.Tensor, offset: torch.Tensor, prompt: int, window: int | None) -> torch.Tensor:
    """[Q, prompt + Q] bool for ``_sdpa_grouped_cross``: query q (token ``offset[q]`` of response ``segment[q]``)
    sees every prompt key (bottom-right aligned: the prompt's last key is just before the response's first token)
    and its own response's keys up to itself; with a window, only the ``window`` latest of those."""
    key_segment = torch.cat([segment.new_full((prompt,), -1), segment])
    key_offset = torch.cat([torch.arange(prompt, device=offset.device) - prompt, offset])
    distance = offset[:, None] - key_offset[None, :]
    mask = ((key_segment[None, :] == -1) | (key_segment[None, :] == segment[:, None])) & (distance >= 0)
    return mask & (distance < window) if window else mask


def _bottom_right_mask(queries: int, keys: int, window: int | None, device) -> torch.Tensor:
    """[queries, keys] bool: query i (the last ``queries`` of ``keys``) sees key j <= i + keys - queries,
    and with a window only the ``window`` latest of them."""
    distance = torch.arange(queries, device=device)[:, None] + (keys - queries) - torch.arange(keys, device=device)
    return (distance >= 0) & (distance < window) if window else distance >= 0


def _flash_attn_kernel(q, k, v, cu_seqlens, max_seqlen, scale, dropout, window, groups, softcap=None):
    return _flash_attn_cross(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale, dropout, window, groups,
                             softcap)


def _torch_varlen_kernel(q, k, v, cu_seqlens, max_seqlen, scale, dropout, window, groups, softcap=None):
    return _torch_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale, dropout, window, groups,
                         softcap)


def _sdpa_kernel(q, k, v, cu_seqlens, _max_seqlen, scale, dropout, window, groups, softcap=None):
    """Causal SDPA per segment, one batched call per distinct segment length.

    Rows of short samples repeat few lengths (the demo task: 3 lengths in 64
    segments), so stacking equal-length segments turns dozens of tiny calls per
    layer into a handful. The row is reordered once so that each length's
    segments are one contiguous block (one gather, one ``split``, one ``cat``,
    one gather back): every op is O(T), forward and backward. Gathering and
    writing back each length group over the whole row instead cost
    O(groups x T), 2-5x slower on long-tailed rows where nearly every
    segment has its own length.
    """
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    blocks = []  # (segments, length, their token positions in the row)
    for length in lengths.unique().tolist():
        index = starts[lengths == length][:, None] + torch.arange(length, device=q.device)  # [n, L]
        blocks.append((index.shape[0], length, index.reshape(-1)))
    order = torch.cat([positions for _, _, positions in blocks])
    sizes = [positions.numel() for _, _, positions in blocks]
    outputs = []
    for (n, length, _), qs, ks, vs in zip(blocks, *(x.index_select(0, order).split(sizes) for x in (q, k, v))):
        qs, ks, vs = (x.reshape(n, length, *x.shape[1:]).transpose(1, 2) for x in (qs, ks, vs))  # [n, H, L, D]
        if softcap is not None:  # SDPA has no softcap
            mask = _bottom_right_mask(length, length, window, q.device)
            attended = _softcapped_attention(qs, ks, vs, mask, scale, dropout, softcap)
        else:
            mask = _sliding_causal_mask(length, window, q.device) if window and window < length else None
            attended = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scale,
                enable_gqa=groups > 1,
            )
        outputs.append(attended.transpose(1, 2).reshape(n * length, *attended.shape[1:2], attended.shape[-1]))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=q.device)
    return torch.cat(outputs).index_select(0, inverse)


def _softcapped_attention(q, k, v, mask, scale, dropout, softcap):
    """Attention with a logit softcap, which SDPA lacks: q [..., Hq, Lq, D], k and v [..., Hkv, Lk, D] -> like q.

    As transformers' Gemma-2 eager attention: scores = softcap * tanh(q @ k.T * scale / softcap), then ``mask``
    (bool, True = attend; or an additive float mask), softmax in fp32; query head h reads KV head h // (Hq / Hkv).
    """
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = (x.repeat_interleave(groups, dim=-3) for x in (k, v))
    scores = (q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)).div(softcap)
    scores = scores.tanh().mul(softcap)
    if mask.dtype == torch.bool:  # the dtype's minimum, not -inf: a fully masked (padding) row stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return (F.dropout(weights, dropout) if dropout else weights) @ v


def _sliding_causal_mask(length: int, window: int, device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def _unpacked_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """Plain SDPA for rows without ``cu_seq_lens_q`` (generation, evaluation, padded batches); explicit with a
    ``softcap``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = query.shape[2]
    if attention_mask is None and length > 1:
        positions = kwargs.get("position_ids")
        if positions is not None and bool((positions[..., 1:] - positions[..., :-1] != 1).any()):
            raise ValueError(
                "position_ids restart inside the row but no cu_seq_lens_q was given: openpack never "
                "guesses packed boundaries; pass PackedBatch.attention_kwargs() (see packed_forward)"
            )
        window = kwargs.get("sliding_window")
        if window and window < length:  # our mask hook returned None; the window still applies
            attention_mask = _sliding_causal_mask(length, window, query.device)[None, None]
    softcap = kwargs.get("softcap")
    if softcap is not None:  # transformers' SDPA ignores it without a word
        if attention_mask is None:  # causal; a single query (decoding) sees every key
            attention_mask = _bottom_right_mask(length, key.shape[2], None, query.device)
        out = _softcapped_attention(query, key, value, attention_mask, scaling, dropout, softcap)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


_KERNELS = {"flash_attn": _flash_attn_kernel, "torch_varlen": _torch_varlen_kernel, "sdpa": _sdpa_kernel}
_CROSS_KERNELS = {"flash_attn": _flash_attn_cross, "torch_varlen": _torch_varlen_cross, "sdpa": _sdpa_cross}


def _mask_for_packed(batch_size, q_length, kv_length, *args, **kwargs):
    """Transformers' mask hook for our implementation name.

    A packed or plain unpadded forward needs no mask (the kernels apply
    causality and any sliding window themselves), which also spares a [T, T]
    mask per packed forward. Padding or a cache fall back to transformers' SDPA mask.
    """
    from transformers.masking_utils import sdpa_mask

    no_offset = kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
    if kwargs.get("attention_mask") is None and q_length == kv_length and no_offset:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, **kwargs)


def register_packed_attention() -> str:
    """Register the attention function and its mask hook; returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask_for_packed)
    return ATTN_IMPLEMENTATION
