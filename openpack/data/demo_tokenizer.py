"""A character-level tokenizer for the demo task, built offline with ``tokenizers``.

One token per character over digits, lowercase letters and ``" \\n+-=:"``,
plus ``<pad> <bos> <eos> <unk>``: 46 tokens, so the demo model's embedding
and output layers stay tiny (46 x 128 at width 128) and every digit of an
answer is its own prediction. Encoding adds no special tokens by itself; the
chat template writes ``<bos>`` and ``<eos>``, so a templated prompt never
starts with two ``<bos>``.

The chat template (assistant turns wrapped in ``{% generation %}`` so
``return_assistant_tokens_mask=True`` marks the tokens to train on)::

    <bos>user: 12+35=
    assistant: 47<eos>

``add_generation_prompt=True`` ends the text at ``"assistant: "``, exactly the
prefix the answer follows in training.
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = string.digits + string.ascii_lowercase + " \n+-=:"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ 'assistant: ' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{%- else -%}"
    "{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}"
)


def build_demo_tokenizer(extra_characters: str = ""):
    """The demo tokenizer as a ``PreTrainedTokenizerFast`` (save/load with the usual HF calls); ``extra_characters``
    get the ids after the demo's own (the agent demo's JSON characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS + extra_characters))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own piece ("[\s\S]", not ".", so "\n" is one too);
    # Fuse joins the pieces back without the spaces WordLevel would put between them.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
