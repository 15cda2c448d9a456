"""What SFT and preference rows share: chat-message checks, --input_template, the common-prefix split, the summary line.

A row's format is read from its keys (``sft.py`` and ``preference.py`` say
which keys mean what) and its values: a string is text, a non-empty list of
``{"role", "content"}`` dicts is a conversation, rendered by the tokenizer's
chat template. The checks here run on every row before any template does,
because a template renders a misspelt role as text ("usr: ...") or fails deep
inside jinja; here the error names the row, the message and the role.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from openpack.data.loading import DataError, skip_or_raise

SKIP_FIX = "or pass --skip_bad_samples to skip and count such rows"
# The roles of OpenAI's chat format that chat templates render; "developer" is its newer name for "system".
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def is_messages(value) -> bool:
    """A non-empty list of ``{"role": str, "content": str}`` dicts."""
    def is_message(m):
        return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

    return isinstance(value, list) and len(value) > 0 and all(is_message(m) for m in value)


def check_roles(messages: list[dict], source: str, key: str) -> None:
    """Every message's role is one of CHAT_ROLES; else a DataError naming the row, the message and the role."""
    for index, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise DataError(
                f"{source}: {key!r} message {index} has role {message['role']!r}; the roles a chat template knows are "
                f"{', '.join(CHAT_ROLES)}. Fix the row, {SKIP_FIX}",
                "unknown chat role",
            )


def as_turn(value, role: str) -> list[dict]:
    """A text value as a one-message conversation (--apply_chat_template); a conversation as it is."""
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def need_chat_template(tokenizer) -> None:
    """Rows with chat messages (or --apply_chat_template) need a tokenizer with a chat template; never skippable."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the rows hold chat messages but the tokenizer has no chat template; use a tokenizer (--pretrain) that "
            "has one, or give the rows as plain text"
        )


def render_chat(tokenizer, source: str, messages: list, **kwargs) -> str:
    """``apply_chat_template(messages, tokenize=False)``; a template that rejects the row names the row."""
    from jinja2 import TemplateError  # transformers' dependency; imported here so the module stays light

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError as err:  # e.g. a template's raise_exception("roles must alternate")
        raise DataError(f"{source}: the chat template rejects this row: {err}; fix the row, {SKIP_FIX}",
                        "rejected by the chat template") from err


def encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=...)["input_ids"]``, the same ids, through the Rust tokenizer's
    ``encode_batch_fast`` when transformers would call it with the same settings (no truncation, no padding, the
    same special-token splitting): it skips offsets and transformers' per-text dicts, 1.5-2x faster on 10k rows
    (demo and SmolLM2 tokenizers, 2 cores)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = (backend is not None and hasattr(backend, "encode_batch_fast") and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))
    if not fast:
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def check_input_template(template: str | None, apply_chat_template: bool) -> None:
    """--input_template must hold ``{}`` and real newlines, and cannot be combined with the chat template."""
    if template is None:
        return
    if "{}" not in template:
        raise DataError(f"--input_template {template!r} has no {{}} where the prompt goes; write it like "
                        "'User: {}\\nAssistant: ' (with a real newline), or drop --input_template")
    if "\\n" in template:
        raise DataError(f"--input_template {template!r} holds the two characters \\n, not a newline; in bash pass "
                        "$'User: {}\\nAssistant: ', or put the template in the --config YAML file")
    if apply_chat_template:
        raise DataError("--input_template formats plain-text prompts and --apply_chat_template makes them chat turns; "
                        "drop one of the two")


def fill_template(template: str | None, prompt: str) -> str:
    """OpenRLHF's ``input_template.format(prompt)``, with ``{}`` the only field (other braces are text)."""
    return prompt if template is None else template.replace("{}", prompt)


def common_prefix(ids: list[int], other: list[int]) -> int:
    """Length of the longest common prefix: where TRL starts a completion (its ``common_prefix_length``)."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


@dataclass
class Outcome:
    """What tokenizing one row gave: a sample, a bad row's error, or why a good row was dropped.

    ``kind`` is the row's format once its keys were read (counted in the summary line even when the row is dropped
    later); ``truncated`` and ``prompt_tail`` say the sample was cut to --max_len or lost its prompt's tail to a BPE
    merge. ``tokenize_sft``/``tokenize_pairs`` fold a list of these (``fold``); the driver's cached pass
    (``prepared.py``) keeps them as a few numbers per row.
    """

    sample: object = None
    error: DataError | None = None  # error.reason None: not skippable (e.g. --overlength_policy error)
    dropped: str | None = None
    kind: str | None = None
    truncated: bool = False
    prompt_tail: bool = False


def fold(outcomes: list[Outcome], skip_bad_samples: bool, report) -> tuple[list, int]:
    """The kept samples of ``outcomes``, in row order, and how many lost a prompt tail; bad rows raise (or are
    counted in ``report.skipped`` when skipping), drops and cuts are counted in ``report``."""
    samples, prompt_tails = [], 0
    for outcome in outcomes:
        if outcome.kind is not None:
            report.formats[outcome.kind] += 1
        if outcome.error is not None:
            skip_or_raise(outcome.error, skip_bad_samples, report.skipped)
        elif outcome.dropped is not None:
            report.dropped += 1
            report.drop_reasons[outcome.dropped] += 1
        else:
            report.truncated += outcome.truncated
            prompt_tails += outcome.prompt_tail
            samples.append(outcome.sample)
    return samples, prompt_tails


def summary(kept: int, noun: str, rows: int, formats: Counter, truncated: int, max_len: int, drop_reasons: Counter,
            skipped: Counter) -> str:
    """The line the driver logs after tokenizing, e.g. ``"3 samples from 4 rows (3 conversation (messages));
    1 truncated to --max_len 2048; dropped: none; skipped: 1 malformed json"``."""
    return (f"{kept} {noun if kept != 1 else noun[:-1]} from {rows} rows ({_counts(formats)}); "
            f"{truncated} truncated to --max_len {max_len}; dropped: {_counts(drop_reasons)}; "
            f"skipped: {_counts(skipped)}")


def _counts(counter: Counter) -> str:
    items = sorted((+counter).items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{n} {what}" for what, n in items) or "none"
