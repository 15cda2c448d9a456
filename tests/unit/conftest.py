"""Tokenizers built offline for the data tests (nothing can be downloaded in CI).

``bpe_tok`` is a byte-level BPE (GPT-2's pre-tokenizer) trained in ~0.5 s on a
few repeated lines, with a ChatML template whose assistant turns are wrapped in
``{% generation %}``. Unlike the demo tokenizer (one token per character) it
merges across a prompt/response boundary: ``"Assistant: "`` ends with the token
``Ġ`` but ``"Assistant: 3"`` ends with ``Ġ3``, so the tokenized prompt is not a
prefix of the tokenized whole, the case TRL's common-prefix rule exists for.
"""

import pytest

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
CORPUS = [
    "User: what is 1+2?\nAssistant: 3 4 5 yes no",
    "the sky is blue, the sky is green",
    "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
] * 20


@pytest.fixture(scope="session")
def bpe_tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    assert tokenizer.convert_ids_to_tokens(tokenizer("Assistant: 3")["input_ids"])[-1] == "Ġ3"  # the merge we rely on
    return tokenizer
