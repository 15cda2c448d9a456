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
    A segment's first token can never be a target.
    """

    tokens: Sequence[int]
    targets: Sequence[bool]
    sample_index: int
    role: int = SAMPLE

    def __post_init__(self):
        if len(self.tokens) != len(self.targets):
            raise ValueError(
                f"sample {self.sample_index}: {len(self.tokens)} tokens but {len(self.targets)} target flags"
            )
        if not self.tokens:
            raise ValueError(f"sample {self.sample_index}: empty segment")


@dataclass
class PackedBatch:
    """A packed row; shapes with T tokens and S segments.

    input_ids, position_ids, labels: [1, T] int64; loss_mask: [1, T] bool;
    segment_ids: [T] int64; cu_seqlens: [S + 1] int32; max_seqlen: int;
    sample_index, role: [S] int64.
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
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }


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
    if (last < 0).any():
        bad = (last < 0).nonzero()[0].item()
        raise ValueError(f"segment {bad} (sample {batch.sample_index[bad].item()}) has no token to read a value at")
    return last


def moved_to(batch, device):
    """A copy of a batch dataclass with every tensor field on ``device`` (other fields as they are)."""
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return type(batch)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def shifted_labels(segment: Segment) -> list[int]:
    """Label of each position: the next token if it is a target, else IGNORE_INDEX; the last predicts nothing."""
    pairs = zip(list(segment.tokens)[1:], list(segment.targets)[1:])
    return [tok if is_target else IGNORE_INDEX for tok, is_target in pairs] + [IGNORE_INDEX]


def collate_packed(segments: Sequence[Segment]) -> PackedBatch:
    """Flatten segments into one PackedBatch, shifting labels inside each segment."""
    if not segments:
        raise ValueError("cannot pack zero segments")
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
