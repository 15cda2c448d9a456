"""Rows to score with a reward model -> token ids, tokenized as ``train_rm`` tokenized its pairs.

A row is scored as one sequence:

* a conversation (``--messages_key``, default ``messages``): the chat
  template's text of the whole conversation, tokenized without adding special
  tokens again (the template writes them), as a conversational pair's side is;
* a prompt and a response (``--prompt_key``, ``--response_key``): the text
  ``prompt + response + eos`` (eos appended unless the response ends with it),
  tokenized with the tokenizer's special tokens, as TRL's RewardTrainer and
  ``train_rm`` tokenize ``prompt + chosen``; with ``apply_chat_template`` (a
  reward model ``train_rm --apply_chat_template`` trained), a user turn and an
  assistant turn of the chat template, as ``train_rm`` rendered such a pair's
  side (``formats.as_turn``), and then exactly the ids of the same row given
  as a conversation.

So a sequence scored here is token for token the sequence the reward model
was trained on, and its reward is the one training computed.
"""

from __future__ import annotations

from openpack.data.formats import as_turn, check_roles, is_messages, need_chat_template, render_chat
from openpack.data.loading import DataError, Rows


def tokenize_for_scoring(rows: Rows, tokenizer, prompt_key: str = "prompt", response_key: str = "response",
                         messages_key: str = "messages",
                         apply_chat_template: bool = False) -> tuple[list[list[int]], int]:
    """Token ids of every row, in row order, and how many were text rows scored as raw text (no template).

    A row of no accepted format is a DataError naming it.
    """
    texts, chat = [], []
    for row, source in zip(rows.rows, rows.sources):
        if is_messages(row.get(messages_key)):
            check_roles(row[messages_key], source, messages_key)
            conversation = row[messages_key]
        elif apply_chat_template and _text_row(row, prompt_key, response_key):  # train_rm --apply_chat_template's turns
            conversation = as_turn(row[prompt_key], "user") + as_turn(row[response_key], "assistant")
        elif _text_row(row, prompt_key, response_key):
            response = row[response_key]
            eos = tokenizer.eos_token or ""
            texts.append(row[prompt_key] + (response if response.endswith(eos) else response + eos))
            chat.append(False)
            continue
        else:
            raise DataError(
                f"{source}: nothing to score: the row has {sorted(row)}; give a conversation under --messages_key "
                f"({messages_key!r}: a list of {{'role', 'content'}} messages), or text under --prompt_key and "
                f"--response_key ({prompt_key!r} and {response_key!r})")
        need_chat_template(tokenizer)
        texts.append(render_chat(tokenizer, source, conversation))
        chat.append(True)
    ids: list = [None] * len(texts)
    for templated in (False, True):
        picked = [i for i, c in enumerate(chat) if c == templated]
        if picked:
            encoded = tokenizer([texts[i] for i in picked], add_special_tokens=not templated)["input_ids"]
            for i, row_ids in zip(picked, encoded):
                ids[i] = row_ids
    return ids, chat.count(False)


def _text_row(row: dict, prompt_key: str, response_key: str) -> bool:
    """A prompt and a response as text (not a conversation): scored raw unless ``apply_chat_template``."""
    return isinstance(row.get(prompt_key), str) and isinstance(row.get(response_key), str)
