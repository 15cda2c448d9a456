"""openpack train_sft on conversations whose chat template has no {% generation %} markers (SmolLM2's), end to end.

The tokenizer is byte-level BPE with no merges (one token per byte, plus
SmolLM2's special tokens), so a tiny model can pair with it; the template is
SmolLM2-135M-Instruct's own (tests/data/chat_templates/smollm2.jinja).
"""

import json
from pathlib import Path

from openpack.cli import train_sft
from openpack.data.loading import Rows
from openpack.data.sft import tokenize_sft

from saved_runs import read_metrics

SMOLLM2_TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "smollm2.jinja"
ROWS = [
    {"messages": [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"},
                  {"role": "user", "content": "and xy"}, {"role": "assistant", "content": "yx"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse hello"},
                  {"role": "assistant", "content": "olleh"}]},
]


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + pre_tokenizers.ByteLevel.alphabet())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = SMOLLM2_TEMPLATE.read_text()
    return tokenizer


def test_train_sft_trains_on_the_assistant_turns_of_smollm2_template_rows(tmp_path):
    """Default --conversation_loss assistant: the run succeeds (it refused such templates before) and its one step
    is normalised by exactly the answers' tokens: 'cba', 'yx', 'olleh', one byte each, plus one <|im_end|> per
    answer = 3 + 2 + 5 + 3 = 13 (tokenize_sft says the same)."""
    from openpack.models.tiny import tiny_causal_lm

    tokenizer = byte_tokenizer()
    pretrain = tmp_path / "tiny"
    tiny_causal_lm("llama", seed=3, vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(pretrain)
    tokenizer.save_pretrained(pretrain)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    argv = ["--pretrain", str(pretrain), "--dataset", str(data), "--save_path", str(tmp_path / "out"),
            "--train_batch_size", "2", "--max_steps", "1", "--max_len", "256", "--launcher", "local"]
    assert train_sft.main(argv) == 0
    samples, _ = tokenize_sft(Rows(ROWS, ["chat.jsonl:1", "chat.jsonl:2"]), tokenizer, max_len=256)
    assert sum(sum(sample.targets) for sample in samples) == 13
    assert [m["loss_tokens"] for m in read_metrics(tmp_path / "out")] == [13]
