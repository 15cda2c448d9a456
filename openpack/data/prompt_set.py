"""An RL prompt set of any size: the usable rows' ids, each prompt read and tokenized when a rollout asks for it.

``rl/worker.py``'s ``load_prompts`` runs the same cached, parallel pass as SFT and DPO data (``prepared.py``) with ``PromptTokenization``:
every row's prompt is checked and tokenized once (a bad row stops the run naming its file and line, or is counted
with --skip_bad_samples; a prompt over --prompt_max_len is left out and counted), and what stays is a
``PromptSet``: 8 bytes a usable prompt (its global row id) plus the pass's 14-byte records while it loads. A
rollout batch's prompts are read by id and tokenized again when asked for (``prompts[i]``), 128 of them in a few
ms, so a million-prompt set costs every rank megabytes, where a list of ``Prompt`` objects (ids, text and the row
dict) cost kilobytes a prompt.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from openpack.core.batch import Segment
from openpack.data import formats
from openpack.data.loading import DataError, DatasetFiles, Rows
from openpack.data.prompts import Prompt, prompt_text


@dataclass
class PromptReport:
    """What the prompt pass left out, and why (bad rows under --skip_bad_samples, and prompts over the cap)."""

    truncated: int = 0
    dropped: int = 0
    skipped: Counter = field(default_factory=Counter)
    drop_reasons: Counter = field(default_factory=Counter)
    formats: Counter = field(default_factory=Counter)
    rows: int = 0

    def left_out(self, load_skipped: Counter | None = None) -> Counter:
        return (load_skipped or Counter()) + self.skipped + self.drop_reasons

    def summary(self, kept: int, max_len: int, load_skipped: Counter | None = None) -> str:
        """``"5 used, 1 bad prompt, 2 longer than --prompt_max_len 8 left out"``, or ``"5"`` when none was."""
        left_out = self.left_out(load_skipped)
        if not left_out:
            return str(kept)
        return f"{kept} used, " + ", ".join(f"{n} {why}" for why, n in sorted(left_out.items())) + " left out"


@dataclass(frozen=True)
class PromptTokenization:
    """How a row becomes a rollout prompt (``prompts.py``): the prompt data flags, as a plain value for the pass."""

    input_key: str = "prompt"
    apply_chat_template: bool = False
    input_template: str | None = None
    prompt_max_len: int = 1024
    label_key: str | None = None

    width = 1  # a prompt is one segment
    noun = "prompts"

    @property
    def max_len(self) -> int:
        return self.prompt_max_len

    def check(self, tokenizer) -> None:
        formats.check_input_template(self.input_template, self.apply_chat_template)

    def report(self, rows: int) -> PromptReport:
        return PromptReport(rows=rows)

    def outcomes(self, rows: Rows, tokenizer) -> list[formats.Outcome]:
        """One ``Outcome`` per row: its ``Prompt``, a bad row's error, or a prompt over --prompt_max_len left out."""
        outcomes = [formats.Outcome() for _ in range(len(rows))]
        texts: dict[bool, list[tuple[int, str]]] = {False: [], True: []}
        for index, (row, source) in enumerate(zip(rows.rows, rows.sources)):
            try:
                texts_of = self._text(row, source, tokenizer)
            except DataError as err:
                outcomes[index].error = err
                continue
            texts[texts_of[1]].append((index, texts_of[0]))
        for chat, items in texts.items():
            if not items:
                continue
            for (index, text), tokens in zip(items, formats.encode(tokenizer, [t for _, t in items], not chat)):
                if len(tokens) > self.prompt_max_len:
                    outcomes[index].dropped = f"longer than --prompt_max_len {self.prompt_max_len}"
                else:
                    outcomes[index].sample = Prompt(tokens, text, rows.rows[index], rows.sources[index])
        return outcomes

    def _text(self, row: dict, source: str, tokenizer) -> tuple[str, bool]:
        if self.input_key not in row:
            raise DataError(f"{source}: no '{self.input_key}' key (keys: {', '.join(map(str, row))}); point "
                            "--input_key at the prompt or pass --skip_bad_samples", reason="no prompt")
        if self.label_key is not None and row.get(self.label_key) is None:
            raise DataError(f"{source}: no '{self.label_key}' (--label_key {self.label_key}, the reference answer "
                            f"rewards get; keys: {', '.join(map(str, row))}); add it to the row, point --label_key "
                            "at the answer's key, or pass --skip_bad_samples", reason="no label")
        return prompt_text(row[self.input_key], tokenizer, source, self.input_key, self.apply_chat_template,
                           self.input_template)

    def segments(self, prompt: Prompt, index: int) -> list[Segment]:
        return [Segment(prompt.tokens, [False] * len(prompt.tokens), index)]

    def nothing_left(self, num_rows: int, report: PromptReport) -> DataError:
        reasons = ", ".join(f"{n} {why}" for why, n in report.left_out().items()) or "no rows"
        return DataError(f"no usable prompt ({reasons}); check --prompt_data, --input_key and --prompt_max_len")


class PromptSet(Sequence):
    """The usable prompts, in the run's order; ``prompts[i]`` reads row ``rows[i]`` and tokenizes it again."""

    def __init__(self, files: DatasetFiles, rows: np.ndarray, tokenizer, how: PromptTokenization):
        self.files, self.rows, self.tokenizer, self.how = files, rows, tokenizer, how

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        if not -len(self) <= index < len(self):
            raise IndexError(f"prompt {index} of {len(self)}")
        return self.take([index])[0]

    def take(self, indices) -> list[Prompt]:
        """The prompts at ``indices``, read and tokenized in one call."""
        rows = self.files.read(self.rows[np.asarray(indices, dtype=np.int64)])
        outcomes = self.how.outcomes(rows, self.tokenizer)
        if any(o.sample is None for o in outcomes):
            raise DataError(f"{rows.sources[0]}: a prompt planned for this run no longer tokenizes as it did; did "
                            "the file change during the run?")
        return [o.sample for o in outcomes]
