"""PackedBatch: many segments in one row, with everything needed to keep them apart.

Two samples packed into one row (sample 0 is a 3-token prompt ``p`` plus a
2-token answer ``a``; sample 1 is prompt ``q`` plus answer ``b``)::

    input_ids     p0 p1 p2 a0 a1 | q0 q1 b0 b1 b2
    position_ids   0  1  2  3  4 |  0  1  2  3  4
    labels         -  -  a0 a1 - |  -  b0 b1 b2 -      (- is IGNORE_INDEX)
    loss_mask      0  0  1  1  0 |  0  1  1  1  0
    segment_ids    0  0  0  0  0 |  1  1  1  1  1
    cu_seqlens    [0, 5, 10]   max_seqlen 5
    sample_index  [0, 1]       role [SAMPLE, SAMPLE]

Labels are shifted *inside* each segment before flattening, so the last token
of a segment predicts nothing; it never learns the next segment's first token
(the bug in verl #6475). Results are read back through the segment table
(``sample_index``, ``role``), never by position or batch halves.

Prefix sharing (``--prefix_sharing``, arXiv 2410.20305): a pair is one group
prompt | chosen | rejected, the prompt computed once. Chosen and rejected are
segments *after* their prompt (``Segment.after_prompt``): they attend to the
prompt and themselves, never to each other; their positions continue the
prompt's; their labels sit on their own tokens, each predicted from the
hidden state of the token before it in prompt + response (``label_source``),
so the first response token of both is predicted from the prompt's last::

    input_ids     p0 p1 p2 | c0 c1 | r0 r1 r2
    position_ids   0  1  2 |  3  4 |  3  4  5
    labels         -  -  - | c0 c1 | r0 r1 r2
    label_source   0  1  2 |  2  3 |  2  5  6
    segments      PROMPT   CHOSEN  REJECTED        (one sample index)

    attention (row sees column):    p p p c c r r r
                               p0   x
                               p1   x x
                               p2   x x x
                               c0   x x x x
                               c1   x x x x x
                               r0   x x x       x
                               r1   x x x       x x
                               r2   x x x       x x x

A sliding window applies in position space: r1 (position 4) under a window of
3 sees p2, r0, r1 (positions 2..4). ``SharedPrefix`` holds this layout in the
form the attention kernels take (``models/attention.py``). A row without such
segments is collated exactly as before, with ``label_source`` and
``shared_prefix`` None.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

IGNORE_INDEX = -100

# Roles a segment can play in its group; a trainer looks results up by role.
SAMPLE, CHOSEN, REJECTED, PROMPT = 0, 1, 2, 3
ROLE_NAMES = ("sample", "chosen", "rejected", "prompt")


@dataclass
class Segment:
    """One tokenized sequence before packing.

    ``targets[i]`` says whether token ``i`` is trained on (predicted from the
    tokens before it); e.g. False for prompt tokens, True for the answer.
    A segment's first token can never be a target, unless the segment is
    ``after_prompt``: it continues the nearest PROMPT segment of its sample
    before it in the row (prefix sharing; see the module docstring), and its
    first token is predicted from that prompt's last.
    """

    tokens: Sequence[int]
    targets: Sequence[bool]
    sample_index: int
    role: int = SAMPLE
    after_prompt: bool = False

    def __post_init__(self):
        if len(self.tokens) != len(self.targets):
            raise ValueError(
                f"sample {self.sample_index}: {len(self.tokens)} tokens but {len(self.targets)} target flags"
            )
        if not self.tokens:
            raise ValueError(f"sample {self.sample_index}: empty segment")

    @property
    def num_labels(self) -> int:
        """Tokens trained on: the targets, less the first token unless it follows a prompt."""
        return sum(self.targets) if self.after_prompt else sum(self.targets[1:])


@dataclass
class SharedPrefix:
    """Prefix-shared groups of a packed row in the form the attention kernels take; T rows.

    Attention runs in two passes, each a plain varlen call. ``main``: every row
    but the later responses, with each prompt and its first response as one
    causal segment (``main_rows`` [M], ``main_cu_seqlens`` int32). ``cross``:
    each later response's rows (``cross_rows`` [X]) over the keys of its prompt
    then itself (``cross_keys`` [K]), causal aligned to the bottom-right corner
    (query i of a response of length n after a prompt of length p sees keys
    0..p + i), ``cross_cu_seqlens_q`` / ``_k`` int32. ``restore`` [T] puts
    ``cat(main, cross)`` back in row order. ``prompt_segment`` [S]: the segment
    each segment follows (-1: none). For the docstring's row::

        main_rows   0 1 2 3 4   main_cu_seqlens [0, 5]     (p0 p1 p2 c0 c1)
        cross_rows  5 6 7       cross_keys 0 1 2 5 6 7     cu_q [0, 3]  cu_k [0, 6]
    """

    prompt_segment: torch.Tensor
    main_rows: torch.Tensor
    main_cu_seqlens: torch.Tensor
    main_max_seqlen: int
    cross_rows: torch.Tensor
    cross_keys: torch.Tensor
    cross_cu_seqlens_q: torch.Tensor
    cross_cu_seqlens_k: torch.Tensor
    cross_max_seqlen_q: int
    cross_max_seqlen_k: int
    restore: torch.Tensor

    def to(self, device) -> "SharedPrefix":
        return moved_to(self, device)


@dataclass
class ContextShard:
    """What one rank of a context group of ``size`` holds of a packed row of T tokens and S segments.

    This rank holds T_r tokens in P pieces (runs of consecutive positions of one segment), in segment order::

        token_index     [T_r] int64  row position of each local token
        piece_segment   [P] int64    the segment each piece belongs to
        piece_offset    [P] int64    the piece's first position within its segment
        piece_length    [P] int64
        cu_seqlens_q    [P + 1] int32  piece boundaries in the local tokens; max_seqlen_q: the longest piece
        segment_starts  [S] int64    where each segment starts in the whole row
        segment_lengths [S] int64    each segment's whole length (length-dependent rope reads it)
        gathered_index  [T] int64    row position -> row of the all-gathered buffer, in which rank q's tokens
                                     fill rows q * max_local_tokens onwards, in its local order

    Every rank of the group computes the same split (``core.context_parallel.split_row``), so each knows where
    every key lands.
    """

    rank: int
    size: int
    token_index: torch.Tensor
    piece_segment: torch.Tensor
    piece_offset: torch.Tensor
    piece_length: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    segment_starts: torch.Tensor
    segment_lengths: torch.Tensor
    gathered_index: torch.Tensor
    max_local_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.token_index.numel()

    def to(self, device) -> "ContextShard":
        return moved_to(self, device)


@dataclass
class PackedBatch:
    """A packed row; shapes with T tokens and S segments.

    input_ids, position_ids, labels: [1, T] int64; loss_mask: [1, T] bool;
    segment_ids: [T] int64; cu_seqlens: [S + 1] int32; max_seqlen: int;
    sample_index, role: [S] int64. ``label_positions`` [N] int64: where the
    labels are, in the flattened row (found on the host by ``to``). With prefix sharing only: label_source
    [T] int64 (``labels[t]`` is predicted from hidden state ``label_source[t]``;
    None means from t itself) and ``shared_prefix``. One rank's part of a row split over a context group
    (``core.context_parallel.shard_batch``): ``context_shard``; ``cu_seqlens`` then counts local tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    sample_index: torch.Tensor
    role: torch.Tensor
    label_source: torch.Tensor | None = None
    shared_prefix: SharedPrefix | None = None
    context_shard: ContextShard | None = None
    label_positions: torch.Tensor | None = None  # set by ``to``: see ``moved_to``

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_segments(self) -> int:
        return self.cu_seqlens.numel() - 1

    def to(self, device) -> "PackedBatch":
        return moved_to(self, device)

    def attention_kwargs(self) -> dict:
        """Keyword arguments a Hugging Face decoder forwards to its attention function."""
        kwargs = {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }
        if self.shared_prefix is not None:
            kwargs["shared_prefix"] = self.shared_prefix
        if self.context_shard is not None:
            kwargs["context_shard"] = self.context_shard
        return kwargs


def last_token_index(batch, skip_token_id: int | None = None) -> torch.Tensor:
    """Where each segment's last token sits in the batch's flattened tokens: [S] int64, in segment order.

    Found from the segment table, never guessed from padding: packed, in the [T] row; padded, in the
    [B * L] rows. ``skip_token_id`` steps back over trailing tokens with that id (transformers' sequence
    classifiers read the last token that is not ``pad_token_id``; with pad == eos that is the token
    before a closing eos), so a reward read here equals the exported model's::

        input_ids   p0 p1 c0 c1 | p0 p1 r0       cu_seqlens [0, 4, 7]
        last token            ^            ^     last_token_index -> [3, 6]
    """
    ids = batch.input_ids.flatten()
    positions = torch.arange(ids.numel(), device=ids.device)
    padded = isinstance(batch, PaddedBatch)
    real = batch.attention_mask.flatten().bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    if skip_token_id is not None:
        real &= ids != skip_token_id
    segment = batch.segment_ids.to(ids.device)
    last = torch.full((batch.num_segments,), -1, dtype=torch.int64, device=ids.device)
    last = last.scatter_reduce(0, segment, torch.where(real, positions, -1), reduce="amax")
    shared = getattr(batch, "shared_prefix", None)
    if shared is not None:  # a response of skipped tokens only reads its prompt's last, as prompt + response would
        prompt = shared.prompt_segment.to(ids.device)
        last = torch.where((last < 0) & (prompt >= 0), last[prompt.clamp(min=0)], last)
    if (last < 0).any():
        bad = (last < 0).nonzero()[0].item()
        raise ValueError(f"segment {bad} (sample {batch.sample_index[bad].item()}) has no token to read a value at")
    return last


def moved_to(batch, device):
    """A copy of a batch dataclass with every tensor field on ``device`` (other fields as they are).

    Nothing here waits for a GPU: copies to it are asynchronous (``host_to_device``), and a batch still on
    the host gets its ``label_positions`` found there, so no one has to ask the GPU where its labels are
    (``nonzero`` on a CUDA tensor waits for every queued kernel).
    """
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    if "label_positions" in values and values["label_positions"] is None and values["labels"].device.type == "cpu":
        values["label_positions"] = label_positions(values["labels"])
    return type(batch)(**{k: v.to(device) if isinstance(v, (SharedPrefix, ContextShard)) else
                          host_to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """Where the labels are in ``labels`` flattened: [N] int64 (on a GPU tensor, ``nonzero`` waits for the GPU)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero()[:, 0]


def host_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor.to(device)``; from the host to a GPU through pinned memory, asynchronously: a copy from pageable
    memory would block the host until every kernel queued before it has run."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def shifted_labels(segment: Segment) -> list[int]:
    """Label of each position: the next token if it is a target, else IGNORE_INDEX; the last predicts nothing."""
    pairs = zip(list(segment.tokens)[1:], list(segment.targets)[1:])
    return [tok if is_target else IGNORE_INDEX for tok, is_target in pairs] + [IGNORE_INDEX]


def collate_packed(segments: Sequence[Segment]) -> PackedBatch:
    """Flatten segments into one PackedBatch, shifting labels inside each segment."""
    if not segments:
        raise ValueError("cannot pack zero segments")
    if any(s.after_prompt for s in segments):
        return _collate_shared(segments)
    lengths = [len(s.tokens) for s in segments]
    input_ids, labels = [], []
    for seg in segments:
        input_ids.extend(seg.tokens)
        labels.extend(shifted_labels(seg))
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths_t, 0)
    segment_ids = torch.repeat_interleave(torch.arange(len(segments)), lengths_t)
    starts = cu_seqlens[:-1].to(torch.int64)[segment_ids]
    labels_t = torch.tensor(labels, dtype=torch.int64)[None]
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64)[None],
        position_ids=(torch.arange(len(input_ids)) - starts)[None],
        labels=labels_t,
        loss_mask=labels_t != IGNORE_INDEX,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
        sample_index=torch.tensor([s.sample_index for s in segments], dtype=torch.int64),
        role=torch.tensor([s.role for s in segments], dtype=torch.int64),
    )


def _collate_shared(segments: Sequence[Segment]) -> PackedBatch:
    """``collate_packed`` for a row with segments after their prompt (the module docstring draws one)."""
    lengths = [len(s.tokens) for s in segments]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    prompt_segment = _prompt_segments(segments)
    positions, labels, sources = [], [], []
    for i, seg in enumerate(segments):
        start, n, p = starts[i], lengths[i], prompt_segment[i]
        if p < 0:
            positions += range(n)
            labels += shifted_labels(seg)
            sources += range(start, start + n)
        else:  # labels on its own tokens, predicted from the token before it in prompt + response
            positions += range(lengths[p], lengths[p] + n)
            labels += [tok if is_target else IGNORE_INDEX for tok, is_target in zip(seg.tokens, seg.targets)]
            sources += [starts[p + 1] - 1, *range(start, start + n - 1)]
    batch = collate_packed([Segment(s.tokens, s.targets, s.sample_index, s.role) for s in segments])
    labels_t = torch.tensor(labels, dtype=torch.int64)[None]
    batch.position_ids = torch.tensor(positions, dtype=torch.int64)[None]
    batch.labels, batch.loss_mask = labels_t, labels_t != IGNORE_INDEX
    batch.label_source = torch.tensor(sources, dtype=torch.int64)
    batch.shared_prefix = _shared_prefix(starts, prompt_segment)
    return batch


def _prompt_segments(segments: Sequence[Segment]) -> list[int]:
    """For each segment, the index of the PROMPT segment it follows (-1: none)."""
    latest: dict[int, int] = {}
    out = []
    for i, seg in enumerate(segments):
        if seg.after_prompt and seg.sample_index not in latest:
            raise ValueError(f"sample {seg.sample_index}: a {ROLE_NAMES[seg.role]} segment follows a prompt, "
                             "but no PROMPT segment of that sample comes before it in the row")
        out.append(latest[seg.sample_index] if seg.after_prompt else -1)
        if seg.role == PROMPT and not seg.after_prompt:
            latest[seg.sample_index] = i
    return out


def _shared_prefix(starts: list[int], prompt_segment: list[int]) -> SharedPrefix:
    """The two attention passes of ``SharedPrefix``: a response right after its prompt joins the prompt's main
    segment; a later one is a cross segment over its prompt's keys and its own."""
    main_rows, main_lengths, cross_rows, cross_keys, q_lengths, k_lengths = [], [], [], [], [], []
    for i, p in enumerate(prompt_segment):
        rows = range(starts[i], starts[i + 1])
        if p >= 0 and p != i - 1:
            cross_rows += rows
            cross_keys += [*range(starts[p], starts[p + 1]), *rows]
            q_lengths.append(len(rows))
            k_lengths.append(starts[p + 1] - starts[p] + len(rows))
            continue
        main_rows += rows
        if p >= 0:
            main_lengths[-1] += len(rows)
        else:
            main_lengths.append(len(rows))
    order = torch.tensor(main_rows + cross_rows, dtype=torch.int64)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    return SharedPrefix(
        prompt_segment=torch.tensor(prompt_segment, dtype=torch.int64),
        main_rows=torch.tensor(main_rows, dtype=torch.int64),
        main_cu_seqlens=_cumulative(main_lengths),
        main_max_seqlen=max(main_lengths),
        cross_rows=torch.tensor(cross_rows, dtype=torch.int64),
        cross_keys=torch.tensor(cross_keys, dtype=torch.int64),
        cross_cu_seqlens_q=_cumulative(q_lengths),
        cross_cu_seqlens_k=_cumulative(k_lengths),
        cross_max_seqlen_q=max(q_lengths, default=0),
        cross_max_seqlen_k=max(k_lengths, default=0),
        restore=restore,
    )


def _cumulative(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


@dataclass
class PaddedBatch:
    """The unpacked layout: one segment per row, right-padded to the longest; shapes [B, L].

    Kept as the baseline that packing must equal (``--packing_samples`` off).
    ``segment_ids`` [B * L] and ``num_segments`` mirror PackedBatch so results
    are read back the same way.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    sample_index: torch.Tensor
    role: torch.Tensor
    label_positions: torch.Tensor | None = None  # set by ``to``: see ``moved_to``

    @property
    def num_segments(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def segment_ids(self) -> torch.Tensor:
        rows, length = self.input_ids.shape
        return torch.arange(rows, device=self.input_ids.device).repeat_interleave(length)

    def to(self, device) -> "PaddedBatch":
        return moved_to(self, device)


def collate_padded(segments: Sequence[Segment], pad_token_id: int = 0) -> PaddedBatch:
    """Right-pad segments into rows of the longest segment's length."""
    if not segments:
        raise ValueError("cannot collate zero segments")
    width = max(len(s.tokens) for s in segments)
    ids = torch.full((len(segments), width), pad_token_id, dtype=torch.int64)
    labels = torch.full((len(segments), width), IGNORE_INDEX, dtype=torch.int64)
    attention = torch.zeros((len(segments), width), dtype=torch.int64)
    for row, seg in enumerate(segments):
        n = len(seg.tokens)
        ids[row, :n] = torch.tensor(list(seg.tokens))
        labels[row, :n] = torch.tensor(shifted_labels(seg))
        attention[row, :n] = 1
    return PaddedBatch(
        input_ids=ids,
        attention_mask=attention,
        labels=labels,
        loss_mask=labels != IGNORE_INDEX,
        sample_index=torch.tensor([s.sample_index for s in segments], dtype=torch.int64),
        role=torch.tensor([s.role for s in segments], dtype=torch.int64),
    )
