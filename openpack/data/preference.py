"""Preference rows -> (prompt, chosen, rejected) token ids, tokenized exactly as TRL 1.16's DPOTrainer does.

``openpack train_dpo`` is checked against TRL loss for loss, so a pair must
become the same tokens here as in ``DPOTrainer._prepare_dataset`` plus
``DataCollatorForPreference``. What TRL 1.16 does, and what we do:

* **Plain-text rows.** TRL appends ``tokenizer.eos_token`` (the string) to
  ``chosen`` and ``rejected`` unless they already end with it, then tokenizes
  ``prompt``, ``prompt + chosen`` and ``prompt + rejected`` with
  ``tokenizer(text)``, i.e. *with* the tokenizer's special tokens (a Llama
  tokenizer adds ``<bos>`` to all three). Same here.
* **Conversational rows** (lists of ``{"role", "content"}`` messages). TRL
  tokenizes ``apply_chat_template(prompt, add_generation_prompt=True)`` and
  ``apply_chat_template(prompt + chosen)`` (and rejected); the template
  writes the special tokens and eos, nothing is appended. Here the template
  is rendered to text and tokenized with ``add_special_tokens=False``, which
  is what ``apply_chat_template(tokenize=True)`` does inside transformers.
* **The split.** ``prompt_len`` is the shorter of the common prefixes of the
  prompt ids with the prompt+chosen and prompt+rejected ids; the prompt is the
  first ``prompt_len`` ids, each completion the rest of its sequence. When a
  BPE merge or the template makes the tokenized prompt not a prefix, the
  prompt's tail is left out of both sequences (TRL warns once; so do we).
* **Truncation.** ``DPOConfig.max_length`` (default 1024) with
  ``truncation_mode="keep_start"`` (the default; ``keep_end`` is deprecated).
  TRL first drops pairs whose prompt alone has ``>= max_length`` tokens
  (no completion token would survive), then its collator cuts each of
  prompt+chosen and prompt+rejected, independently, to its first
  ``max_length`` tokens: the *end of the completion* is cut (eos included),
  the prompt is never cut. ``--overlength_policy truncate`` does the same,
  once at load time instead of per batch (a slice, so the ids are equal).
  Completions that agree on more tokens than the room left become equal
  sequences after the cut: TRL keeps such pairs, we drop them (below).
  ``--max_len`` defaults to 2048 here: pass ``--max_len 1024`` (or set
  ``DPOConfig(max_length=2048)``) when comparing with TRL's defaults.
* **Implicit prompt.** A row without ``--prompt_key`` holds two whole
  conversations (or texts) in ``chosen`` and ``rejected``; as TRL's
  ``extract_prompt`` does, their shared leading turns (or characters, less a
  trailing space) are the prompt and the rest the completions.
* **OpenRLHF's flags.** ``--apply_chat_template`` makes a text prompt a user
  turn and text completions assistant turns, which TRL tokenizes as the
  conversational row they become; ``--input_template``
  (``"User: {}\\nAssistant: "``) formats a text prompt before anything else.

Where we differ from TRL, on purpose:

* **Pairs identical after truncation are dropped.** Completions that agree
  on more tokens than ``--max_len`` leaves after the prompt become the same
  sequence after the cut. TRL keeps such a pair: its preference loss is
  then a constant (the margin is 0 whatever the weights, so no gradient),
  yet it counts in the mean over pairs and dilutes every other pair's
  gradient. We drop it and count it under ``identical after truncation to
  --max_len`` in the summary line.
* **Stricter rows.** A row with a missing or empty field, a non-string
  value, an unknown chat role, text mixed with messages, an implicit prompt
  that cannot be found (nothing shared, or one side the start of the other),
  chosen and rejected that tokenize to the same completion, or a split
  leaving the prompt or a completion with no token (our segments never train
  on their first token) is an error (or counted with ``--skip_bad_samples``);
  TRL would train on it, or fail deep inside ``datasets.map``. TRL's
  ``tools`` / ``chat_template_kwargs`` columns are not supported.

Trade-off: like ``sft.py``, tokenization is batched (three texts per row in
one fast-tokenizer call per row kind), so the prompt is tokenized three
times, as TRL does, rather than once; that is the price of TRL's exact
boundary rule. Measured on 2 (busy) CPU cores: 10k pairs of ~140 tokens a
side with the demo tokenizer take 8 s, 85% of it in ``encode_batch``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

from openpack.core.batch import CHOSEN, PROMPT, REJECTED, Segment
from openpack.data import formats
from openpack.data.formats import SKIP_FIX, as_turn, check_roles, common_prefix, fill_template, is_messages
from openpack.data.loading import DataError, Rows
from openpack.data.sft import OVERLENGTH_POLICIES

logger = logging.getLogger(__name__)

FIELDS = ("prompt", "chosen", "rejected")  # also the flags: --prompt_key, --chosen_key, --rejected_key
IDENTICAL_AFTER_TRUNCATION = "identical after truncation to --max_len"


@dataclass
class PreferencePair:
    """One tokenized pair; the model sees ``prompt + chosen`` and ``prompt + rejected``.

    ``{"prompt": "1+2=", "chosen": "3", "rejected": "4"}`` with the demo
    tokenizer (eos appended to both completions)::

        chosen     1  +  2  =  3  <eos>      tokens  5 42 6 44 7 2
        targets    F  F  F  F  T  T
        rejected   1  +  2  =  4  <eos>      tokens  5 42 6 44 8 2
        targets    F  F  F  F  T  T
    """

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    source: str
    row: int = field(default=-1, compare=False)  # index in the Rows it was tokenized from
    margin: float = 0.0  # how much chosen should beat rejected (a reward model's --margin_key); 0 without one

    def segments(self, sample_index: int) -> list[Segment]:
        """[prompt+chosen (role CHOSEN), prompt+rejected (role REJECTED)], targets on the completion only."""
        return [
            self._segment(self.chosen, sample_index, CHOSEN),
            self._segment(self.rejected, sample_index, REJECTED),
        ]

    def _segment(self, completion: list[int], sample_index: int, role: int) -> Segment:
        targets = [False] * len(self.prompt) + [True] * len(completion)
        return Segment(self.prompt + completion, targets, sample_index, role)

    def lengths(self) -> tuple[int, int]:
        """Tokens in (prompt+chosen, prompt+rejected)."""
        return len(self.prompt) + len(self.chosen), len(self.prompt) + len(self.rejected)

    def shared_segments(self, sample_index: int) -> list[Segment]:
        """--prefix_sharing: [prompt (PROMPT), chosen (CHOSEN), rejected (REJECTED)], one group computing the
        prompt once; chosen and rejected follow it (``Segment.after_prompt``) and train on every token, the same
        tokens ``segments`` trains on. The example above is 4 + 2 + 2 = 8 tokens instead of 12."""
        return [
            Segment(self.prompt, [False] * len(self.prompt), sample_index, PROMPT),
            Segment(self.chosen, [True] * len(self.chosen), sample_index, CHOSEN, after_prompt=True),
            Segment(self.rejected, [True] * len(self.rejected), sample_index, REJECTED, after_prompt=True),
        ]


def pair_segments(prefix_sharing: bool):
    """How a pair becomes segments, ``(pair, sample_index) -> list[Segment]``: two sequences prompt + chosen and
    prompt + rejected, or one prompt | chosen | rejected group with ``--prefix_sharing``."""
    return PreferencePair.shared_segments if prefix_sharing else PreferencePair.segments


@dataclass
class PreferenceReport:
    """What ``tokenize_pairs`` read and changed: rows per format, pairs cut to --max_len, dropped (why), skipped."""

    truncated: int
    dropped: int
    skipped: Counter
    drop_reasons: Counter = field(default_factory=Counter)
    formats: Counter = field(default_factory=Counter, compare=False)  # good rows per format
    rows: int = field(default=0, compare=False)  # rows given to tokenize_pairs

    def summary(self, kept: int, max_len: int, load_skipped: Counter | None = None) -> str:
        """The driver's line: ``"1 pair from 2 rows (2 text prompt/chosen/rejected); 0 truncated ..."``."""
        return formats.summary(kept, "pairs", self.rows, self.formats, self.truncated, max_len, self.drop_reasons,
                               (load_skipped or Counter()) + self.skipped)


@dataclass
class _Rendered:
    """The three texts TRL tokenizes for one row, and whether they came from the chat template."""

    texts: tuple[str, str, str]  # prompt, prompt + chosen, prompt + rejected
    chat: bool
    source: str
    row: int = -1
    kind: str = ""  # the format, as the report counts it
    margin: float = 0.0


@dataclass(frozen=True)
class PairTokenization:
    """How rows become preference pairs: the flags that read a row and cut it (module docstring). A plain value, so
    the driver's parallel pass (``prepared.py``) can send it to its processes and key its cache by it;
    ``prefix_sharing`` says how a pair packs (``pair_segments``)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_len: int = 2048
    overlength: str = "truncate"
    apply_chat_template: bool = False
    input_template: str | None = None
    margin_key: str | None = None
    prefix_sharing: bool = False

    noun = "pairs"  # the summary line's unit

    @property
    def width(self) -> int:
        """Segments per sample."""
        return 3 if self.prefix_sharing else 2

    def report(self, rows: int) -> PreferenceReport:
        return PreferenceReport(truncated=0, dropped=0, skipped=Counter(), rows=rows)

    def check(self, tokenizer) -> None:
        """The flags' own errors, before any row is read."""
        _check_args(self.max_len, self.overlength)
        formats.check_input_template(self.input_template, self.apply_chat_template)

    def _keys(self) -> dict:
        return dict(zip(FIELDS, (self.prompt_key, self.chosen_key, self.rejected_key)))

    def outcomes(self, rows: Rows, tokenizer) -> list[formats.Outcome]:
        """One ``Outcome`` per row, in row order: a ``PreferencePair`` (its ``row`` set), a bad row's error, or a
        drop."""
        keys, flags = self._keys(), _Flags(self.apply_chat_template, self.input_template, self.margin_key)
        outcomes = [formats.Outcome() for _ in range(len(rows))]
        rendered = []
        for index, (row, source) in enumerate(zip(rows.rows, rows.sources)):
            try:
                values, kind = _row_values(row, source, keys)
                item = _render(tokenizer, *values, source, keys, flags)
                margin = _margin(row, source, flags.margin_key) if flags.margin_key else 0.0
            except DataError as err:
                outcomes[index].error = err
                continue
            item = dataclasses.replace(item, row=index, kind=f"{'chat' if item.chat else 'text'} {kind}",
                                       margin=margin)
            outcomes[index].kind = item.kind
            rendered.append(item)
        for (prompt_ids, chosen_ids, rejected_ids), item in zip(_encode(tokenizer, rendered), rendered):
            outcome = outcomes[item.row]
            try:
                pair = _split(prompt_ids, chosen_ids, rejected_ids, item.source, keys)
                outcome.prompt_tail = len(pair.prompt) < len(prompt_ids)
                _fit_length(pair, self.max_len, self.overlength, outcome)
            except DataError as err:
                outcome.error = err
                continue
            if outcome.sample is not None:
                outcome.sample.row, outcome.sample.margin = item.row, item.margin
        return outcomes

    def segments(self, pair: PreferencePair, index: int) -> list[Segment]:
        return pair_segments(self.prefix_sharing)(pair, index)

    def nothing_left(self, num_rows: int, report: PreferenceReport) -> DataError:
        return _nothing_left(num_rows, self.max_len, self._keys(), report)


def tokenize_pairs(
    rows: Rows,
    tokenizer,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    max_len: int = 2048,
    overlength: str = "truncate",
    skip_bad_samples: bool = False,
    warn: bool = True,
    *,
    apply_chat_template: bool = False,
    input_template: str | None = None,
    margin_key: str | None = None,
) -> tuple[list[PreferencePair], PreferenceReport]:
    """Tokenize preference rows as TRL 1.16's DPOTrainer does (see the module docstring).

    ``max_len`` bounds each of prompt+chosen and prompt+rejected. ``overlength``:
    ``truncate`` keeps the first ``max_len`` tokens of each (TRL's
    ``keep_start``), ``drop`` drops and counts the pair, ``error`` raises. A
    prompt of ``max_len`` tokens or more leaves no room for a response: it is
    an error under ``error`` and dropped and counted otherwise. Bad rows raise
    DataError naming the row, key and flag, or are counted in
    ``report.skipped`` with ``skip_bad_samples``. ``apply_chat_template``
    makes text prompts user turns and text completions assistant turns;
    ``input_template`` formats text prompts (OpenRLHF's flags). ``margin_key`` names a
    number per row that each pair's margin is read from (reward models, Llama 2's margin).
    """
    how = PairTokenization(prompt_key, chosen_key, rejected_key, max_len, overlength, apply_chat_template,
                           input_template, margin_key)
    how.check(tokenizer)
    report = how.report(len(rows))  # load skips: rows.skipped
    pairs, prompt_tails = formats.fold(how.outcomes(rows, tokenizer), skip_bad_samples, report)
    if prompt_tails and warn:  # workers re-tokenizing their micro-batches pass warn=False: the driver warned
        warn_prompt_tails(prompt_tails)
    if not pairs:
        raise how.nothing_left(len(rows), report)
    return pairs, report


def warn_prompt_tails(count: int) -> None:
    logger.warning("%d pairs: the tokenized prompt is not a prefix of prompt+completion (a BPE merge or the chat "
                   "template); its tail is left out of the sequence, as TRL does", count)


def _check_args(max_len: int, overlength: str) -> None:
    if overlength not in OVERLENGTH_POLICIES:
        raise DataError(f"--overlength_policy must be one of {', '.join(OVERLENGTH_POLICIES)}, got {overlength!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise DataError(f"--max_len must be an integer >= 2 (a prompt token and a target), got {max_len!r}")


@dataclass(frozen=True)
class _Flags:
    apply_chat_template: bool
    input_template: str | None
    margin_key: str | None = None


def _margin(row: dict, source: str, key: str) -> float:
    """The row's margin under ``--margin_key``: a finite number (a JSON number, not text)."""
    if key not in row:
        raise DataError(f"{source}: no key {key!r} (--margin_key; the row has {sorted(row)}); give every row a "
                        f"margin, drop --margin_key, {SKIP_FIX}", "missing margin")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{source}: {key!r} (--margin_key) is {value!r}, not a finite number; write it as a JSON "
                        f"number, e.g. 1.5, {SKIP_FIX}", "non-numeric margin")
    return float(value)


def _row_values(row: dict, source: str, keys: dict) -> tuple[list, str]:
    """(prompt, chosen, rejected) and the format: an explicit prompt, or TRL's implicit one when the row has none."""
    if keys["prompt"] in row:
        return [_field(row, source, keys[name], name, keys) for name in FIELDS], "/".join(keys.values())
    chosen, rejected = (_field(row, source, keys[name], name, keys) for name in ("chosen", "rejected"))
    return _implicit_prompt(chosen, rejected, source, keys), f"{keys['chosen']}/{keys['rejected']} (implicit prompt)"


def _implicit_prompt(chosen, rejected, source: str, keys: dict) -> list:
    """TRL's ``extract_prompt``: the shared leading turns (or characters) of chosen and rejected are the prompt.

    For text, a space just before the point where they part goes with the
    completions, as in TRL: "1+2= 3" vs "1+2= 4" -> "1+2=" | " 3" vs " 4".
    """
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise DataError(f"{source}: {keys['chosen']!r} and {keys['rejected']!r} must both be text or both be "
                        f"messages, {SKIP_FIX}", "text mixed with messages")
    shared = common_prefix(chosen, rejected)
    if 0 < shared < min(len(chosen), len(rejected)) and isinstance(chosen, str) and chosen[shared - 1] == " ":
        shared -= 1
    if 0 < shared < min(len(chosen), len(rejected)):
        return [chosen[:shared], chosen[shared:], rejected[shared:]]
    why = ("share no start to take as the prompt" if shared == 0
           else "leave no completion: one is the start of the other")
    raise DataError(
        f"{source}: no key {keys['prompt']!r} (--prompt_key), and {keys['chosen']!r} and {keys['rejected']!r} {why} "
        f"(TRL's implicit-prompt format); set --prompt_key, fix the row, {SKIP_FIX}. "
        f"Accepted formats:\n{_accepted(keys)}",
        f"missing key {keys['prompt']!r}",
    )


def _accepted(keys: dict) -> str:
    """The formats a row may take, each with a one-row example under the current keys."""
    turn = [{"role": "user", "content": "1+2="}]
    explicit = {keys["prompt"]: "1+2=", keys["chosen"]: "3", keys["rejected"]: "4"}
    implicit = {keys["chosen"]: turn + [{"role": "assistant", "content": "3"}],
                keys["rejected"]: turn + [{"role": "assistant", "content": "4"}]}
    return "\n".join((
        f"  a prompt and two completions (--prompt_key {keys['prompt']} --chosen_key {keys['chosen']} --rejected_key "
        f"{keys['rejected']}), text or lists of messages: {json.dumps(explicit)}",
        "  TRL's implicit prompt, two whole conversations (or texts) whose shared start is the prompt: "
        f"{json.dumps(implicit)}",
    ))


def _field(row: dict, source: str, key: str, name: str, keys: dict):
    """``row[key]``: a non-empty string or a non-empty list of chat messages with known roles."""
    flag = f"--{name}_key"
    if key not in row:
        raise DataError(
            f"{source}: no key {key!r} (the row has {sorted(row)}); set {flag} to the key that holds the "
            f"{name}, {SKIP_FIX}. Accepted formats:\n{_accepted(keys)}",
            f"missing key {key!r}",
        )
    value = row[key]
    if (isinstance(value, str) and not value.strip()) or value == []:
        raise DataError(
            f"{source}: {key!r} (the {name}, {flag}) is empty, so the pair has nothing to compare; "
            f"fix the row, {SKIP_FIX}",
            f"empty {key!r}",
        )
    if isinstance(value, str):
        return value
    if is_messages(value):
        check_roles(value, source, key)
        return value
    raise DataError(
        f"{source}: {key!r} is a {type(value).__name__}, expected a string or a list of "
        f"{{'role', 'content'}} messages; check {flag}, {SKIP_FIX}",
        f"non-string {key!r}",
    )


def _render(tokenizer, prompt, chosen, rejected, source: str, keys: dict, flags: _Flags) -> _Rendered:
    """TRL's texts: eos appended to plain completions, or the chat template around message lists."""
    kinds = [isinstance(v, list) for v in (prompt, chosen, rejected)]
    if any(kinds) and not all(kinds) and not flags.apply_chat_template:
        described = ", ".join(f"{keys[n]!r} is {'messages' if k else 'text'}" for n, k in zip(FIELDS, kinds))
        raise DataError(
            f"{source}: {described}; give all three as strings or all three as lists of messages (or pass "
            f"--apply_chat_template to make text a chat turn), {SKIP_FIX}",
            "text mixed with messages",
        )
    if any(kinds) or flags.apply_chat_template:
        turns = as_turn(prompt, "user"), as_turn(chosen, "assistant"), as_turn(rejected, "assistant")
        return _Rendered(_chat_texts(tokenizer, *turns, source), True, source)
    eos = tokenizer.eos_token
    if eos is None:
        raise DataError(
            "the tokenizer has no eos_token, which plain-text pairs need (TRL appends it to chosen and rejected); "
            "use a tokenizer (--pretrain) with an eos token, or give the pairs as chat messages"
        )
    prompt = fill_template(flags.input_template, prompt)
    chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
    return _Rendered((prompt, prompt + chosen, prompt + rejected), False, source)


def _chat_texts(tokenizer, prompt: list, chosen: list, rejected: list, source: str) -> tuple[str, str, str]:
    formats.need_chat_template(tokenizer)
    return (
        formats.render_chat(tokenizer, source, prompt, add_generation_prompt=True),
        formats.render_chat(tokenizer, source, prompt + chosen),
        formats.render_chat(tokenizer, source, prompt + rejected),
    )


def _encode(tokenizer, rendered: list[_Rendered]) -> list[list[list[int]]]:
    """Token ids of each row's three texts, one batched call per kind of row.

    Plain text gets the tokenizer's special tokens (TRL calls ``tokenizer(text)``);
    templated text already has them (HF's chat-template docs: adding them again
    duplicates ``<bos>``), as in ``apply_chat_template(tokenize=True)``.
    """
    ids: list = [None] * len(rendered)
    for chat in (False, True):
        rows = [i for i, r in enumerate(rendered) if r.chat == chat]
        if not rows:
            continue
        flat = formats.encode(tokenizer, [t for i in rows for t in rendered[i].texts], not chat)
        for j, i in enumerate(rows):
            ids[i] = flat[3 * j : 3 * j + 3]
    return ids


def _split(prompt_ids, chosen_ids, rejected_ids, source: str, keys: dict) -> PreferencePair:
    """Cut at TRL's ``prompt_len``: the shorter common prefix of the prompt with either sequence."""
    prompt_len = min(common_prefix(prompt_ids, chosen_ids), common_prefix(prompt_ids, rejected_ids))
    pair = PreferencePair(list(prompt_ids[:prompt_len]), chosen_ids[prompt_len:], rejected_ids[prompt_len:], source)
    empty = [keys[name] for name, ids in (("prompt", pair.prompt), ("chosen", pair.chosen),
                                          ("rejected", pair.rejected)) if not ids]
    if empty:
        # A sequence's first token is never a target (core/batch.py), so each side needs a prompt token and a target.
        raise DataError(
            f"{source}: {' and '.join(map(repr, empty))} tokenize to no tokens of their own (the prompt and "
            f"completion merge at the boundary); end the prompt on a token boundary, {SKIP_FIX}",
            "no tokens after split",
        )
    if pair.chosen == pair.rejected:
        raise DataError(
            f"{source}: {keys['chosen']!r} and {keys['rejected']!r} give the same {len(pair.chosen)} completion "
            f"tokens (after eos or the chat template is added), so there is nothing to prefer; fix the row, {SKIP_FIX}",
            "chosen same as rejected",
        )
    return pair


def _fit_length(pair: PreferencePair, max_len: int, overlength: str, outcome: formats.Outcome) -> None:
    """Apply the --overlength_policy to both sequences: the pair, cut or not, or why it is dropped, into
    ``outcome``."""
    chosen_len, rejected_len = pair.lengths()
    if max(chosen_len, rejected_len) <= max_len:
        outcome.sample = pair
        return
    prompt_fills = len(pair.prompt) >= max_len  # TRL's filter: no completion token would survive keep_start
    if overlength == "error":
        raise _overlength_error(pair, max_len, prompt_fills)
    if overlength == "drop" or prompt_fills:
        outcome.dropped = "prompt fills --max_len, no response left" if prompt_fills else "over --max_len"
        return
    room = max_len - len(pair.prompt)  # TRL's collator: (prompt + completion)[:max_length], the prompt is kept whole
    chosen, rejected = pair.chosen[:room], pair.rejected[:room]
    if chosen == rejected:  # no signal left; TRL trains on it (module docstring)
        outcome.dropped = IDENTICAL_AFTER_TRUNCATION
        return
    outcome.truncated = True
    outcome.sample = PreferencePair(pair.prompt, chosen, rejected, pair.source)


def _overlength_error(pair: PreferencePair, max_len: int, prompt_fills: bool) -> DataError:
    choices = (
        "raise --max_len, or set --overlength_policy to truncate (keep the first --max_len tokens of each sequence, "
        "as TRL does) or drop (skip and count); it is now error"
    )
    if prompt_fills:
        return DataError(
            f"{pair.source}: the prompt alone is {len(pair.prompt)} tokens, >= --max_len {max_len}, so there is no "
            f"room for a response; {choices}"
        )
    chosen_len, rejected_len = pair.lengths()
    side, length, completion = (
        ("chosen", chosen_len, pair.chosen) if chosen_len > max_len else ("rejected", rejected_len, pair.rejected)
    )
    return DataError(
        f"{pair.source}: prompt+{side} is {length} tokens ({len(pair.prompt)} prompt + {len(completion)} {side}), "
        f"over --max_len {max_len}; {choices}"
    )


def _nothing_left(num_rows: int, max_len: int, keys: dict, report: PreferenceReport) -> DataError:
    why = ", ".join(f"{n} {reason}" for reason, n in (report.skipped + report.drop_reasons).most_common())
    return DataError(
        f"no preference pairs left from {num_rows} rows: {report.dropped} dropped and "
        f"{sum(report.skipped.values())} skipped ({why or 'no rows'}); check --prompt_key/--chosen_key/"
        f"--rejected_key (now {keys['prompt']}/{keys['chosen']}/{keys['rejected']}), raise --max_len "
        f"(now {max_len}) or set --overlength_policy truncate"
    )
