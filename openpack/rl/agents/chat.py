"""An observation's ids: its text as is, or its chat messages through the template as a delta after a turn.

A multi-turn episode's context is never the conversation rendered and encoded again: the sampled ids stay as
sampled, and only what the environment adds is encoded. For chat messages that is the template's rendering of
those messages after an assistant turn: the template is rendered for a fixed conversation that ends with an
assistant turn, with and without the new messages (and the next generation prompt), and the difference is taken.
What the template writes after the assistant's end-of-turn token (ChatML's newline after ``<|im_end|>``) opens
the delta, since the engine stops at that token.
"""

from __future__ import annotations

_BASE = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class ChatTemplateError(ValueError):
    """A chat template that cannot render an observation as a delta after an assistant turn."""


def text_ids(tokenizer, text: str) -> list[int]:
    """A text observation's ids, as the tokenizer encodes it alone (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_ids(tokenizer, observation, tools: list[dict] | None = None) -> list[int]:
    """The ids of an episode's first observation: text as is, messages with the template's generation prompt."""
    if isinstance(observation, str):
        return text_ids(tokenizer, observation)
    return list(_render(tokenizer, observation, tools, add_generation_prompt=True))


def observation_ids(tokenizer, observation, last_action: list[int], tools: list[dict] | None = None) -> list[int]:
    """The ids appended after ``last_action`` (the sampled ids) for a later observation."""
    if isinstance(observation, str):
        return text_ids(tokenizer, observation)
    before = _render(tokenizer, _BASE, tools, add_generation_prompt=False)
    after = _render(tokenizer, _BASE + list(observation), tools, add_generation_prompt=True)
    if after[:len(before)] != before:
        raise ChatTemplateError("the chat template renders an earlier turn differently once later messages follow "
                                "it, so an observation cannot be appended as ids; give text observations, or a "
                                "template whose rendering of a conversation is a prefix of its continuation's")
    end = tokenizer.eos_token_id
    closing = before[_last_index(before, end):] if end in before else []  # e.g. <|im_end|> "\n"
    if closing and last_action and last_action[-1] == end:
        closing = closing[1:]  # the engine sampled the end-of-turn token itself
    return closing + after[len(before):]


def _render(tokenizer, messages, tools, add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("chat-message observations need a tokenizer with a chat template; give text")
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    return list(ids)


def _last_index(ids: list[int], token: int) -> int:
    return len(ids) - 1 - ids[::-1].index(token)
