"""SFT rows -> token ids plus a per-token "train on this" flag, with a length policy.

A row ``{"prompt": "1+2=", "response": "3"}`` with ``--apply_chat_template``
and the demo tokenizer becomes::

    text     <bos> u s e r :  _ 1 + 2 = \\n a s s i s t a n t : _ | 3 <eos>
    targets    F   F F F F F  F F F F F  F  F F F F F F F F F F F | T   T

The prompt and the response are tokenized separately and concatenated, so the
boundary between them is exact (tokenizing the whole text and searching for
the boundary breaks when a BPE merge spans it). The cost is that the pair may
tokenize differently from the joined text at that one boundary, which is also
how the model sees the prompt at generation time (prompt first, then sampled
tokens), so training matches inference.

Tokenization is batched (one fast-tokenizer call for all prompts, one for all
responses), so the Rust tokenizer does the work rather than a Python loop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from openpack.data.loading import DataError, Rows, skip_or_raise

OVERLENGTH_POLICIES = ("truncate", "drop", "error")


@dataclass
class SFTSample:
    """One tokenized sample; ``targets`` is True on response tokens (and eos), False on the prompt."""

    tokens: list[int]
    targets: list[bool]
    source: str
    row: int = field(default=-1, compare=False)  # index in the Rows it was tokenized from


@dataclass
class TokenizeReport:
    """What ``tokenize_sft`` changed: samples cut to --max_len, dropped, and skipped as bad.

    ``drop_reasons`` says why each dropped sample went (over --max_len under
    ``drop``; a prompt that fills --max_len under ``truncate``).
    """

    truncated: int
    dropped: int
    skipped: Counter
    drop_reasons: Counter = field(default_factory=Counter)


def tokenize_sft(
    rows: Rows,
    tokenizer,
    input_key: str,
    output_key: str,
    apply_chat_template: bool,
    max_len: int,
    overlength: str = "truncate",
    skip_bad_samples: bool = False,
) -> tuple[list[SFTSample], TokenizeReport]:
    """Tokenize SFT rows: prompt tokens are not targets, response tokens and eos are.

    With ``apply_chat_template`` the prompt is the chat template of the user
    turn with the generation prompt, the response the rest of the templated
    conversation (the template writes eos and other special tokens). The
    input may also be a list of ``{"role", "content"}`` messages. Without it,
    prompt and response are the raw values and eos is appended.

    ``overlength`` handles samples longer than ``max_len`` tokens:
    ``truncate`` keeps the first ``max_len`` tokens (a sample whose prompt
    leaves no response token is dropped and counted), ``drop`` drops and
    counts, ``error`` raises. Bad rows (missing key, non-string value, empty
    response) raise DataError, or are counted in ``report.skipped`` when
    ``skip_bad_samples``.
    """
    _check_args(tokenizer, apply_chat_template, max_len, overlength)
    report = TokenizeReport(truncated=0, dropped=0, skipped=Counter())  # load-time skips stay in rows.skipped
    texts, sources, row_ids = _format_rows(rows, tokenizer, input_key, output_key, apply_chat_template,
                                           skip_bad_samples, report)
    prompts, responses = _encode_pairs(tokenizer, texts, apply_chat_template)
    samples = []
    for prompt_ids, response_ids, source, row in zip(prompts, responses, sources, row_ids):
        sample = _fit_length(prompt_ids, response_ids, source, max_len, overlength, report)
        if sample is not None:
            sample.row = row
            samples.append(sample)
    if not samples:
        raise _nothing_left(len(rows), max_len, report)
    return samples, report


def _check_args(tokenizer, apply_chat_template: bool, max_len: int, overlength: str) -> None:
    if overlength not in OVERLENGTH_POLICIES:
        raise DataError(f"--overlength_policy must be one of {', '.join(OVERLENGTH_POLICIES)}, got {overlength!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise DataError(f"--max_len must be an integer >= 2 (a prompt token and a target), got {max_len!r}")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "--apply_chat_template is set but the tokenizer has no chat template; "
            "drop --apply_chat_template or use a tokenizer (--pretrain) that has one"
        )


def _format_rows(rows, tokenizer, input_key, output_key, apply_chat_template, skip, report):
    """(prompt text, response text) per good row, with its source and index; bad rows raise or are counted."""
    texts, sources, row_ids = [], [], []
    for index, (row, source) in enumerate(zip(rows.rows, rows.sources)):
        try:
            prompt = _field(row, source, input_key, "--input_key", allow_messages=apply_chat_template)
            response = _field(row, source, output_key, "--output_key", allow_messages=False)
            if not response.strip():
                raise DataError(
                    f"{source}: {output_key!r} is empty or only whitespace, so there is nothing to train on; "
                    "fix the row, or pass --skip_bad_samples to skip and count such rows",
                    "empty response",
                )
            pair = _chat_texts(tokenizer, prompt, response, source) if apply_chat_template else (prompt, response)
        except DataError as err:
            skip_or_raise(err, skip, report.skipped)
            continue
        texts.append(pair)
        sources.append(source)
        row_ids.append(index)
    return texts, sources, row_ids


def _field(row: dict, source: str, key: str, flag: str, allow_messages: bool):
    """``row[key]``, which must be a string (or a list of chat messages when allowed)."""
    if key not in row:
        raise DataError(
            f"{source}: no key {key!r} (the row has {sorted(row)}); set {flag} to the key that holds "
            "this text, or pass --skip_bad_samples to skip and count such rows",
            f"missing key {key!r}",
        )
    value = row[key]
    if isinstance(value, str) or (allow_messages and _is_messages(value)):
        return value
    expected = "a string or a list of {'role', 'content'} messages" if allow_messages else "a string"
    raise DataError(
        f"{source}: {key!r} is a {type(value).__name__}, expected {expected}; check {flag}, "
        "or pass --skip_bad_samples to skip and count such rows",
        f"non-string {key!r}",
    )


def _is_messages(value) -> bool:
    """A non-empty list of ``{"role": str, "content": str}`` dicts."""
    def is_message(m):
        return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

    return isinstance(value, list) and len(value) > 0 and all(is_message(m) for m in value)


def _chat_texts(tokenizer, prompt, response: str, source: str) -> tuple[str, str]:
    """Prompt text (with the generation prompt) and the text the template adds for the response."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    if not full_text.startswith(prompt_text):
        raise DataError(
            f"{source}: the chat template's text with the answer does not start with its text with the "
            f"generation prompt ({prompt_text[-40:]!r} vs {full_text[len(prompt_text) - 40:len(prompt_text)]!r}), "
            "so prompt and response cannot be split; use a template whose generation prompt is a prefix, "
            "or drop --apply_chat_template and give plain prompt text",
            "chat template prefix mismatch",
        )
    return prompt_text, full_text[len(prompt_text) :]


def _encode_pairs(tokenizer, texts: list[tuple[str, str]], apply_chat_template: bool):
    """Token ids of prompts and responses, each in one batched call.

    A templated prompt already has its special tokens (HF's chat-template docs:
    tokenizing it with ``add_special_tokens=True`` duplicates e.g. ``<bos>``),
    so special tokens are added to plain-text prompts only. Plain responses
    get eos appended (unless they already end with it).
    """
    if not texts:
        return [], []
    prompts = tokenizer([p for p, _ in texts], add_special_tokens=not apply_chat_template)["input_ids"]
    responses = tokenizer([r for _, r in texts], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if not apply_chat_template and eos is not None:
        responses = [ids if ids and ids[-1] == eos else ids + [eos] for ids in responses]
    return prompts, responses


def _fit_length(prompt_ids, response_ids, source, max_len, overlength, report) -> SFTSample | None:
    """Apply the --overlength_policy; None when the sample is dropped (counted in ``report``)."""
    tokens = list(prompt_ids) + list(response_ids)
    targets = [False] * len(prompt_ids) + [True] * len(response_ids)
    if len(tokens) <= max_len:
        return SFTSample(tokens, targets, source)
    if overlength == "error":
        raise DataError(
            f"{source}: {len(tokens)} tokens ({len(prompt_ids)} prompt + {len(response_ids)} response) is "
            f"over --max_len {max_len}; raise --max_len, or set --overlength_policy to truncate (keep the "
            "first --max_len tokens) or drop (skip and count); it is now error"
        )
    # Truncating a prompt of >= max_len tokens would leave no target; max_len >= 2 keeps one past position 0.
    if overlength == "drop" or len(prompt_ids) >= max_len:
        reason = "over --max_len" if overlength == "drop" else "prompt fills --max_len, no response left"
        report.dropped += 1
        report.drop_reasons[reason] += 1
        return None
    report.truncated += 1
    return SFTSample(tokens[:max_len], targets[:max_len], source)


def _nothing_left(num_rows: int, max_len: int, report: TokenizeReport) -> DataError:
    why = ", ".join(f"{n} {reason}" for reason, n in (report.skipped + report.drop_reasons).most_common())
    return DataError(
        f"no SFT samples left from {num_rows} rows: {report.dropped} dropped and "
        f"{sum(report.skipped.values())} skipped ({why or 'no rows'}); check --input_key/--output_key, "
        f"raise --max_len (now {max_len}) or set --overlength_policy truncate"
    )
