"""Prompts for online RL: rows -> the token ids a rollout engine continues, with the row kept for rewards.

A row's ``--input_key`` holds a text prompt or a list of chat messages. A
text prompt is sent as it is, or filled into ``--input_template``, or (with
``--apply_chat_template``) made a user turn of the tokenizer's chat template;
messages always go through the template, which ends with the assistant's
generation prompt. Exactly the rule SFT uses for its prompts, so a model
trained by ``openpack train_sft`` sees the same prefix when it is sampled
here.

A prompt longer than ``--prompt_max_len`` tokens is dropped and counted (it
would leave no room to answer, and cutting it would change the question),
as OpenRLHF filters its prompt dataset; an empty or missing prompt is a
``DataError`` naming the row, or counted under ``--skip_bad_samples``
(``prompt_set.py``: a set of any size, tokenized once and cached).
"""

from __future__ import annotations

from dataclasses import dataclass

from openpack.data.formats import as_turn, fill_template, is_messages, need_chat_template, render_chat
from openpack.data.loading import DataError


@dataclass
class Prompt:
    """One prompt as the engine sees it: ``tokens`` (ids), ``text`` (the string they encode) and its dataset row."""

    tokens: list[int]
    text: str
    row: dict
    source: str


def prompt_text(value, tokenizer, source: str, input_key: str, apply_chat_template: bool,
                input_template: str | None) -> tuple[str, bool]:
    """The string a row's prompt becomes, and whether a chat template rendered it (it then holds its own bos)."""
    if is_messages(value):
        need_chat_template(tokenizer)
        return render_chat(tokenizer, source, value, add_generation_prompt=True), True
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{source}: '{input_key}' is {str(value)[:60]!r}, not a prompt (a non-empty string or a list "
                        "of chat messages); fix the row, point --input_key at the prompt, or pass --skip_bad_samples",
                        reason="bad prompt")
    if apply_chat_template:
        need_chat_template(tokenizer)
        return render_chat(tokenizer, source, as_turn(value, "user"), add_generation_prompt=True), True
    return fill_template(input_template, value), False
