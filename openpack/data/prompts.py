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
``DataError`` naming the row, or counted under ``--skip_bad_samples``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from openpack.data.formats import as_turn, fill_template, is_messages, need_chat_template, render_chat
from openpack.data.loading import DataError, Rows, skip_or_raise


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


def tokenize_prompts(rows: Rows, tokenizer, input_key: str = "prompt", apply_chat_template: bool = False,
                     input_template: str | None = None, prompt_max_len: int = 1024,
                     skip_bad_samples: bool = False, label_key: str | None = None) -> tuple[list[Prompt], Counter]:
    """Every usable row's prompt, in row order, and why rows were left out (``Counter`` of reasons). With
    ``label_key`` (``--label_key``) every row must hold a reference answer: checked here, before any rollout."""
    prompts, left_out = [], Counter()
    for row, source in zip(rows.rows, rows.sources):
        if input_key not in row:
            skip_or_raise(DataError(f"{source}: no '{input_key}' key (keys: {', '.join(map(str, row))}); point "
                                    "--input_key at the prompt or pass --skip_bad_samples", reason="no prompt"),
                          skip_bad_samples, left_out)
            continue
        if label_key is not None and row.get(label_key) is None:
            skip_or_raise(DataError(f"{source}: no '{label_key}' (--label_key {label_key}, the reference answer "
                                    f"rewards get; keys: {', '.join(map(str, row))}); add it to the row, point "
                                    "--label_key at the answer's key, or pass --skip_bad_samples", reason="no label"),
                          skip_bad_samples, left_out)
            continue
        try:
            text, chat = prompt_text(row[input_key], tokenizer, source, input_key, apply_chat_template, input_template)
        except DataError as err:
            skip_or_raise(err, skip_bad_samples, left_out)
            continue
        tokens = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if len(tokens) > prompt_max_len:
            left_out[f"longer than --prompt_max_len {prompt_max_len}"] += 1
            continue
        prompts.append(Prompt(tokens, text, row, source))
    if not prompts:
        reasons = ", ".join(f"{n} {why}" for why, n in left_out.items()) or "no rows"
        raise DataError(f"no usable prompt ({reasons}); check --prompt_data, --input_key and --prompt_max_len")
    return prompts, left_out
