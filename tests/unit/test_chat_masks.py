"""--conversation_loss assistant with chat templates that have no {% generation %} markers (issue 23).

The targets are found by rendering prefixes (``sft.assistant_targets_by_prefix``):
each assistant turn's content and its end-of-turn token, nothing else. The
templates in tests/data/chat_templates/ are the public ones, byte for byte:
SmolLM2-135M-Instruct's (from its tokenizer), and Qwen2.5-Instruct's, Llama-3's
and Llama-3.1's as TRL 1.16 stores them (trl/chat_templates/, kept identical to
the Hub for its identity checks), plus TRL's marked Llama-3 and Qwen2.5
training variants. Tokenizers are built offline: ``bpe_tok`` (a byte-level BPE,
tests/unit/conftest.py), and SmolLM2's own when /work/smollm2 holds it.
"""

import copy
import re
from pathlib import Path

import pytest

from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import DataError, Rows
from openpack.data.sft import tokenize_sft

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
SMOLLM2 = Path("/work/smollm2")  # examples/real_model_check.py's converted SmolLM2-135M-Instruct
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama-3's pre-tokenizer (its tokenizer.json): "\n\n" is one piece whatever follows it, unlike GPT-2's regex
LLAMA_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
END_OF_TURN = {"smollm2": "<|im_end|>", "qwen2_5": "<|im_end|>", "llama3": "<|eot_id|>", "llama3_1": "<|eot_id|>"}


def message(role, content):
    return {"role": role, "content": content}


ANSWERS = ["4.", "6, since 3 + 3 = 6.", "You're welcome! Ask again any time."]
CONVERSATION = [message("system", "Be brief."), message("user", "What is 2+2?"), message("assistant", ANSWERS[0]),
                message("user", "And 3+3?"), message("assistant", ANSWERS[1]), message("user", "Thanks!"),
                message("assistant", ANSWERS[2])]
NO_SYSTEM = CONVERSATION[1:5]  # the template's default system prompt, if it has one, goes first


@pytest.fixture(scope="module", params=["bpe", "smollm2"])
def base_tok(request, bpe_tok):
    if request.param == "bpe":
        return bpe_tok
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip("no SmolLM2 tokenizer at /work/smollm2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2)


def with_template(tokenizer, name):
    """A copy of ``tokenizer`` with tests/data/chat_templates/<name>.jinja; Llama's get its special tokens and
    pre-tokenizer, as their own tokenizer has them."""
    tokenizer = copy.deepcopy(tokenizer)
    if name.startswith("llama"):
        from tokenizers import Regex, pre_tokenizers

        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_SPECIAL})
        tokenizer.bos_token = "<|begin_of_text|>"
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def rows_of(*conversations):
    return Rows([{"messages": c} for c in conversations], [f"chat.jsonl:{i + 1}" for i in range(len(conversations))])


def target_spans(tokenizer, sample):
    """The decoded runs of consecutive targets."""
    spans, run = [], []
    for token, target in zip(sample.tokens + [None], sample.targets + [False]):
        if target:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


@pytest.mark.parametrize("name", ["smollm2", "qwen2_5", "llama3", "llama3_1"])
def test_targets_are_each_answer_and_its_end_of_turn(base_tok, name):
    """System + three user/assistant turns, and two turns under the template's default system prompt: the targets
    decode to exactly the answers, each with its end-of-turn token; the tokens are the template's own."""
    tokenizer = with_template(base_tok, name)
    assert "{% generation" not in tokenizer.chat_template and "{%- generation" not in tokenizer.chat_template
    samples, _ = tokenize_sft(rows_of(CONVERSATION, NO_SYSTEM), tokenizer, max_len=4096)
    eot = END_OF_TURN[name]
    assert target_spans(tokenizer, samples[0]) == [answer + eot for answer in ANSWERS]
    assert target_spans(tokenizer, samples[1]) == [answer + eot for answer in ANSWERS[:2]]
    for sample, conversation in zip(samples, (CONVERSATION, NO_SYSTEM)):
        assert sample.tokens == tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)


def test_qwen_tool_call_turn_is_a_target(bpe_tok):
    """Qwen2.5: an assistant turn that calls a tool is trained on (its <tool_call> block and <|im_end|>); the tool's
    answer, rendered as a user turn, is context."""
    tokenizer = with_template(bpe_tok, "qwen2_5")
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    conversation = [message("user", "2+2?"), call, message("tool", "4"), message("assistant", "It is 4.")]
    samples, _ = tokenize_sft(rows_of(conversation), tokenizer, max_len=4096)
    assert target_spans(tokenizer, samples[0]) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>', "It is 4.<|im_end|>"]


def marked_and_prefix(tokenizer, marked_template, plain_template, conversations):
    """(tokens, targets) from the {% generation %} markers and from prefixes, row by row."""
    results = []
    for template in (marked_template, plain_template):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = template
        samples, _ = tokenize_sft(rows_of(*conversations), tokenizer, max_len=4096)
        results.append([(s.tokens, s.targets) for s in samples])
    return results


def unmarked(template):
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


DEMO_CONVERSATIONS = [  # tests/unit/test_sft_data.py's, for the demo tokenizer's template
    [message("user", "1+2="), message("assistant", "3"), message("user", "2+2="), message("assistant", "4")],
    [message("system", "be brief"), message("user", "x"), message("assistant", "yes")],
    [message("user", "hi"), message("assistant", "hello"), message("user", "bye"), message("assistant", "")],
    [message("tool", "42"), message("user", "ok?"), message("assistant", "ok")],
]


def test_prefixes_agree_with_markers_on_the_demo_and_chatml_templates(bpe_tok):
    """The same template with and without its {% generation %} markers gives the same tokens and targets: the demo
    one (<eos> ends a turn, nothing follows), ChatML (the '\\n' after <|im_end|> is context under both), including
    an answer whose first character merges with the generation prompt's '\\n' ('assistant\\n' + '\\n\\nHi' is
    'assistant', '\\n\\n', '\\n', 'Hi'): the merged token is the first target under both."""
    chatml = bpe_tok.chat_template  # conftest's CHATML_TEMPLATE ("from conftest import" can get tests/integration's)
    demo = build_demo_tokenizer()
    marked, by_prefix = marked_and_prefix(demo, demo.chat_template, unmarked(demo.chat_template), DEMO_CONVERSATIONS)
    assert marked == by_prefix and len(marked) == 4
    merging = with_newline_merge(bpe_tok)
    newlines = [message("user", "Hi"), message("assistant", "\n\nHi there")]
    prompt = merging.apply_chat_template(newlines[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = merging.apply_chat_template(newlines, tokenize=True, return_dict=False)
    assert whole[:len(prompt)] != prompt and merging.decode(whole[len(prompt) - 1]) == "\n\n"  # the merge
    marked, by_prefix = marked_and_prefix(merging, chatml, unmarked(chatml),
                                          [CONVERSATION, NO_SYSTEM, newlines])
    assert marked == by_prefix and len(marked) == 3


def with_newline_merge(tokenizer):
    """``tokenizer`` (byte-level BPE) with the merge 'Ċ Ċ' (two newlines) added, as SmolLM2's and GPT-2's have."""
    import json

    from tokenizers import Tokenizer

    tokenizer = copy.deepcopy(tokenizer)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    model["vocab"]["ĊĊ"] = max(model["vocab"].values()) + 1
    model["merges"].append(["Ċ", "Ċ"] if isinstance(model["merges"][0], list) else "Ċ Ċ")
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
    return tokenizer


def test_prefixes_on_llama3_agree_with_trls_marked_llama3_training_template(bpe_tok):
    """TRL's oracle: its llama3_training.jinja is the original with {% generation %} around content + <|eot_id|>.
    The original by prefixes == TRL's training variant by markers, token for token."""
    tokenizer = with_template(bpe_tok, "llama3")
    marked, by_prefix = marked_and_prefix(tokenizer, (TEMPLATES / "llama3_training_trl.jinja").read_text(),
                                          tokenizer.chat_template, [CONVERSATION, NO_SYSTEM])
    assert marked == by_prefix


def test_trls_qwen_training_template_marks_more_than_the_prefixes(bpe_tok):
    """Where they cannot agree, and why the markers path is kept for marked templates: TRL's Qwen2.5 training
    template also marks the '\\n' that ends '<|im_start|>assistant\\n' (the generation prompt) and the '\\n' after
    <|im_end|>; by prefixes both are context."""
    tokenizer = with_template(bpe_tok, "qwen2_5")
    marked, by_prefix = marked_and_prefix(tokenizer, (TEMPLATES / "qwen2_5_training_trl.jinja").read_text(),
                                          tokenizer.chat_template, [NO_SYSTEM])
    (tokens, marked_targets), (same_tokens, prefix_targets) = marked[0], by_prefix[0]
    assert tokens == same_tokens
    extra = [tokenizer.decode([t]) for t, m, p in zip(tokens, marked_targets, prefix_targets) if m and not p]
    assert extra == ["\n"] * 4 and not any(p and not m for m, p in zip(marked_targets, prefix_targets))


# A ChatML template that drops earlier assistant turns' reasoning, as DeepSeek-R1's and Qwen3's do.
STRIPS_REASONING = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
REASONING = [message("user", "2+2?"), message("assistant", "<think>2 and 2</think>4"), message("user", "3+3?"),
             message("assistant", "6")]


def test_template_that_rewrites_earlier_turns_is_refused(bpe_tok):
    """messages[:2] ends '<think>2 and 2</think>4<|im_end|>', the whole conversation has '4<|im_end|>' there: no
    tokens to train on can be found for that turn. The row is named with the flag and both fixes; a row that the
    template renders the same way whatever follows is fine, and --skip_bad_samples counts the other."""
    tokenizer = copy.deepcopy(bpe_tok)
    tokenizer.chat_template = STRIPS_REASONING
    plain = [message("user", "2+2?"), message("assistant", "4"), message("user", "3+3?"), message("assistant", "6")]
    with pytest.raises(DataError) as err:
        tokenize_sft(rows_of(plain, REASONING), tokenizer)
    text = str(err.value)
    assert text.startswith("chat.jsonl:2: --conversation_loss assistant (the default) finds assistant message 1's")
    assert "not a prefix" in text and "--conversation_loss all" in text and "{% generation %}" in text
    assert "--skip_bad_samples" in text and err.value.reason == "chat template not prefix-preserving"
    samples, report = tokenize_sft(rows_of(plain, REASONING), tokenizer, skip_bad_samples=True)
    assert [s.row for s in samples] == [0] and report.skipped == {"chat template not prefix-preserving": 1}
    assert target_spans(tokenizer, samples[0]) == ["4<|im_end|>", "6<|im_end|>"]
    samples, _ = tokenize_sft(rows_of(REASONING), tokenizer, conversation_loss="all")
    assert all(samples[0].targets)


def test_generation_prompt_other_than_the_assistant_header_is_refused():
    """The demo template without markers, whose generation prompt says 'assistant: ' but whose turns say 'bot: ':
    the prompt is not even a text prefix: after "<bos>user: 1+2=\\n" (12 tokens) they differ."""
    odd = build_demo_tokenizer()
    odd.chat_template = unmarked(odd.chat_template).replace("'assistant: ' }}{{", "'bot: ' }}{{")
    assert "bot: " in odd.chat_template
    with pytest.raises(DataError, match=r"chat.jsonl:1: .*messages\[:1\] with the generation prompt as tokens that "
                                        r"are not a prefix of those of messages\[:2\]: they part at token 12 \('ass' vs 'bot'\)"):
        tokenize_sft(rows_of(DEMO_CONVERSATIONS[0]), odd)


def test_the_worker_tokenizes_smollm2_rows_with_assistant_loss(bpe_tok):
    """What train_sft's workers call (sft_worker._tokenize) with the default flags on SmolLM2-template rows."""
    from openpack.config import sft
    from openpack.config.schema import parse_config
    from openpack.trainers.sft_worker import _tokenize

    data_config = parse_config(["--pretrain", "m", "--dataset", "d.jsonl"], "t", "", *sft.CONFIGS)[1]
    tokenizer = with_template(bpe_tok, "smollm2")
    samples = _tokenize(rows_of(CONVERSATION), tokenizer, data_config)
    assert data_config.conversation_loss == "assistant"
    assert target_spans(tokenizer, samples[0]) == [answer + "<|im_end|>" for answer in ANSWERS]
