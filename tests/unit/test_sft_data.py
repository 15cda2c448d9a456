"""tokenize_sft: exact tokens and targets with the demo tokenizer, bad rows, and length policies.

Demo vocabulary (openpack/data/demo_tokenizer.py): <pad> <bos> <eos> <unk> are
0-3, digits '0'-'9' are 4-13, 'a'-'z' are 14-39, then ' ' 40, '\\n' 41, '+' 42,
'-' 43, '=' 44, ':' 45. So "us" is 34 32, "1+2=" is 5 42 6 44, "3" is 7.
"""

from collections import Counter

import pytest

from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import DataError, Rows
from openpack.data.sft import OVERLENGTH_POLICIES, SFTSample, tokenize_sft

BOS, EOS = 1, 2
# "user: " then "1+2=\n", then "assistant: "
USER = [34, 32, 18, 31, 45, 40]
ASSISTANT = [14, 32, 32, 22, 32, 33, 14, 27, 33, 45, 40]
PROMPT_1_PLUS_2 = [BOS, *USER, 5, 42, 6, 44, 41, *ASSISTANT]  # 23 tokens


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def rows_of(*rows):
    return Rows(list(rows), [f"train.jsonl:{i + 1}" for i in range(len(rows))])


def tokenize(tok, rows, **kwargs):
    settings = dict(input_key="prompt", output_key="response", apply_chat_template=True, max_len=64)
    return tokenize_sft(rows, tok, **{**settings, **kwargs})


def test_chat_sample_tokens_and_targets_literal(tok):
    """<bos>user: 1+2=\\nassistant: | 3<eos>: 23 prompt tokens (not targets), then '3' and eos (targets)."""
    samples, report = tokenize(tok, rows_of({"prompt": "1+2=", "response": "3"}))
    assert samples == [SFTSample(PROMPT_1_PLUS_2 + [7, EOS], [False] * 23 + [True, True], "train.jsonl:1")]
    assert tok.decode(samples[0].tokens) == "<bos>user: 1+2=\nassistant: 3<eos>"
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert tok.decode(samples[0].tokens) == tok.apply_chat_template(chat, tokenize=False)
    assert report.truncated == report.dropped == 0 and report.skipped == Counter()


def test_input_may_be_a_list_of_chat_messages(tok):
    messages = [{"role": "user", "content": "1+2="}]
    samples, _ = tokenize(tok, rows_of({"prompt": messages, "response": "3"}))
    assert samples[0].tokens == PROMPT_1_PLUS_2 + [7, EOS]


def test_plain_text_appends_eos(tok):
    rows = rows_of({"q": "1+2=", "a": "3"})
    samples, _ = tokenize(tok, rows, input_key="q", output_key="a", apply_chat_template=False)
    assert samples == [SFTSample([5, 42, 6, 44, 7, EOS], [False] * 4 + [True, True], "train.jsonl:1")]


def test_chat_template_required_when_asked(tok):
    plain = build_demo_tokenizer()
    plain.chat_template = None
    with pytest.raises(DataError, match="--apply_chat_template"):
        tokenize(plain, rows_of({"prompt": "1+2=", "response": "3"}))


def test_missing_key_names_row_key_present_keys_and_flag(tok):
    rows = rows_of({"prompt": "1+2=", "response": "3"}, {"question": "2+2=", "response": "4"})
    with pytest.raises(DataError) as err:
        tokenize(tok, rows)
    message = str(err.value)
    assert "train.jsonl:2" in message and "'prompt'" in message and "--input_key" in message
    assert "['question', 'response']" in message and "--skip_bad_samples" in message
    with pytest.raises(DataError, match="--output_key"):
        tokenize(tok, rows_of({"prompt": "1+2="}))


def test_bad_rows_are_counted_when_skipping(tok):
    rows = rows_of(
        {"prompt": "1+2=", "response": "3"},
        {"question": "2+2=", "response": "4"},
        {"prompt": "2+2=", "response": 4},
        {"prompt": "2+2=", "response": "  "},
        {"prompt": "2+2=", "response": ""},
    )
    samples, report = tokenize(tok, rows, skip_bad_samples=True)
    assert [s.source for s in samples] == ["train.jsonl:1"]
    assert [s.row for s in samples] == [0]  # the driver's sample -> row map that ranks re-tokenize from
    assert report.skipped == Counter({"missing key 'prompt'": 1, "non-string 'response'": 1, "empty response": 2})


@pytest.mark.parametrize("response", ["", " \n "])
def test_empty_response_is_an_error(tok, response):
    with pytest.raises(DataError, match="empty or only whitespace") as err:
        tokenize(tok, rows_of({"prompt": "1+2=", "response": response}))
    assert "train.jsonl:1" in str(err.value)


def test_non_string_value_is_an_error(tok):
    with pytest.raises(DataError, match="is a int, expected a string") as err:
        tokenize(tok, rows_of({"prompt": "1+2=", "response": 3}))
    assert "--output_key" in str(err.value)


def test_template_whose_prompt_is_not_a_prefix_splits_where_they_differ(tok, caplog):
    """TRL's rule, not an error: the generation prompt says 'assistant: ' but the answer turn 'bot: ', so the tokens
    part after '<bos>user: 1+2=\\n' (12 tokens); the rest of the whole text is the target, and a warning says so."""
    odd = build_demo_tokenizer()
    odd.chat_template = odd.chat_template.replace("'assistant: ' }}{% generation", "'bot: ' }}{% generation")
    samples, _ = tokenize(odd, rows_of({"prompt": "1+2=", "response": "3"}))
    assert odd.decode(samples[0].tokens) == "<bos>user: 1+2=\nbot: 3<eos>"
    assert samples[0].targets == [False] * 12 + [True] * 7
    assert "1 samples: the tokenized prompt is not a prefix" in caplog.text


# Lengths: "1+2=" -> 23 prompt + 2 response tokens; "1+2=" with "333" -> 23 + 4 = 27.
LONG = {"prompt": "1+2=", "response": "333"}
SHORT = {"prompt": "1+2=", "response": "3"}


def test_truncate_keeps_the_first_max_len_tokens(tok):
    samples, report = tokenize(tok, rows_of(LONG, SHORT), max_len=25, overlength="truncate")
    assert samples[0].tokens == PROMPT_1_PLUS_2 + [7, 7]
    assert samples[0].targets == [False] * 23 + [True, True]
    assert samples[1].tokens == PROMPT_1_PLUS_2 + [7, EOS]  # exactly max_len: untouched
    assert report.truncated == 1 and report.dropped == 0


def test_truncate_keeps_at_least_one_target(tok):
    samples, report = tokenize(tok, rows_of(LONG), max_len=24)
    assert samples[0].targets == [False] * 23 + [True] and report.truncated == 1


def test_truncate_drops_and_counts_a_prompt_that_fills_max_len(tok):
    samples, report = tokenize(tok, rows_of(LONG, {"prompt": "1+2=1+2=", "response": "3"}), max_len=26)
    assert [s.source for s in samples] == ["train.jsonl:1"] and report.truncated == 1
    assert report.dropped == 1 and report.drop_reasons == Counter({"prompt fills --max_len, no response left": 1})


def test_drop_policy_counts(tok):
    samples, report = tokenize(tok, rows_of(LONG, SHORT), max_len=25, overlength="drop")
    assert [s.source for s in samples] == ["train.jsonl:2"]
    assert report.dropped == 1 and report.truncated == 0 and report.drop_reasons == Counter({"over --max_len": 1})


def test_error_policy_names_row_length_flag_and_choices(tok):
    with pytest.raises(DataError) as err:
        tokenize(tok, rows_of(SHORT, LONG), max_len=25, overlength="error")
    message = str(err.value)
    assert "train.jsonl:2" in message and "27 tokens" in message and "--max_len 25" in message
    assert "--overlength_policy" in message and all(choice in message for choice in OVERLENGTH_POLICIES)


def test_unknown_policy_and_tiny_max_len_are_errors(tok):
    with pytest.raises(DataError, match="--overlength_policy must be one of truncate, drop, error"):
        tokenize(tok, rows_of(SHORT), overlength="clip")
    with pytest.raises(DataError, match="--max_len"):
        tokenize(tok, rows_of(SHORT), max_len=1)


def test_nothing_left_says_how_many_were_dropped_and_skipped(tok):
    rows = rows_of(LONG, {"question": "1+2=", "response": "3"})
    with pytest.raises(DataError) as err:
        tokenize(tok, rows, max_len=20, overlength="drop", skip_bad_samples=True)
    message = str(err.value)
    assert "no SFT samples left from 2 rows" in message and "1 dropped and 1 skipped" in message
    assert "over --max_len" in message and "missing key 'prompt'" in message


# ---- formats: conversations, TRL prompt/completion, OpenRLHF's keys and --input_template -------------------------


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


# "user: 2+2=\nassistant: " after the first answer: the demo template writes <bos> once, at the start
SECOND_TURN = [*USER, 6, 42, 6, 44, 41, *ASSISTANT]  # 22 tokens
TWO_TURNS = user("1+2=") + assistant("3") + user("2+2=") + assistant("4")


def test_messages_row_trains_on_assistant_turns_only(tok):
    """TRL's assistant_only_loss: the {% generation %} spans ('3<eos>', '4<eos>') are targets, nothing else."""
    samples, report = tokenize(tok, rows_of({"messages": TWO_TURNS}))
    assert samples[0].tokens == PROMPT_1_PLUS_2 + [7, EOS] + SECOND_TURN + [8, EOS]
    assert samples[0].targets == [False] * 23 + [True] * 2 + [False] * 22 + [True] * 2
    assert report.formats == Counter({"conversation (messages)": 1})


def test_conversation_loss_all_trains_on_every_token(tok):
    samples, _ = tokenize(tok, rows_of({"messages": TWO_TURNS}), conversation_loss="all")
    assert samples[0].tokens == PROMPT_1_PLUS_2 + [7, EOS] + SECOND_TURN + [8, EOS]
    assert samples[0].targets == [True] * 49


def test_messages_key_flag(tok):
    samples, report = tokenize(tok, rows_of({"chat": TWO_TURNS}), messages_key="chat")
    assert len(samples[0].tokens) == 49 and report.formats == Counter({"conversation (chat)": 1})


def test_trl_prompt_completion_text(tok):
    """{"prompt", "completion"} is TRL's format; text appends eos and trains on the completion."""
    samples, report = tokenize(tok, rows_of({"prompt": "1+2=", "completion": "3"}), apply_chat_template=False)
    assert samples == [SFTSample([5, 42, 6, 44, 7, EOS], [False] * 4 + [True, True], "train.jsonl:1")]
    assert report.formats == Counter({"text prompt/completion": 1})


def test_trl_prompt_completion_messages_need_no_flag(tok):
    """Lists of messages are always templated, as TRL does; the completion is the target."""
    row = {"prompt": user("1+2="), "completion": assistant("3")}
    samples, report = tokenize(tok, rows_of(row), apply_chat_template=False)
    assert samples == [SFTSample(PROMPT_1_PLUS_2 + [7, EOS], [False] * 23 + [True] * 2, "train.jsonl:1")]
    assert report.formats == Counter({"chat prompt/completion": 1})


def test_text_mixed_with_messages_needs_apply_chat_template(tok):
    row = {"prompt": user("1+2="), "response": "3"}
    match = r"train.jsonl:1: 'prompt' is messages, 'response' is text.*--apply_chat_template"
    with pytest.raises(DataError, match=match) as err:
        tokenize(tok, rows_of(row), apply_chat_template=False)
    assert err.value.reason == "text mixed with messages"


def test_completion_starts_where_prompt_and_whole_diverge(tok, bpe_tok):
    """TRL's rule: tokenize the prompt and prompt+completion; the completion starts at their first difference.

    BPE: 'Assistant: ' ends with the token 'Ġ' alone, 'Assistant: 3' with 'Ġ3': the whole text's tokens are
    kept and 'Ġ3' is the first target. Demo tokenizer: 'ab<eo' + 's>x' reads '<eos>' as one token.
    """
    row = {"prompt": "User: 1+2=\nAssistant: ", "response": "3"}
    samples, _ = tokenize(bpe_tok, rows_of(row), apply_chat_template=False)
    whole = bpe_tok("User: 1+2=\nAssistant: 3<|im_end|>")["input_ids"]
    assert samples[0].tokens == whole and bpe_tok.convert_ids_to_tokens(whole[-2:]) == ["Ġ3", "<|im_end|>"]
    assert samples[0].targets == [False] * (len(whole) - 2) + [True, True]
    samples, _ = tokenize(tok, rows_of({"prompt": "ab<eo", "response": "s>x"}), apply_chat_template=False)
    assert samples == [SFTSample([14, 15, EOS, 37, EOS], [False, False, True, True, True], "train.jsonl:1")]


def test_input_template_formats_text_prompts(tok):
    """OpenRLHF's --input_template: the prompt becomes template.format(prompt); 'q: 1+2=\\na: ' is 11 tokens."""
    rows = rows_of({"prompt": "1+2=", "response": "3"})
    samples, _ = tokenize(tok, rows, apply_chat_template=False, input_template="q: {}\na: ")
    assert tok.decode(samples[0].tokens) == "q: 1+2=\na: 3<eos>"
    assert samples[0].targets == [False] * 11 + [True] * 2


def test_input_template_leaves_trls_rows_as_trl_reads_them(tok):
    """The template is OpenRLHF's flag for OpenRLHF's keys: a row read by --input_key/--output_key gets it, TRL's
    prompt/completion row in the same file does not (TRL adds no template)."""
    rows = rows_of({"prompt": "1+2=", "response": "3"}, {"prompt": "1+2=", "completion": "3"})
    samples, _ = tokenize(tok, rows, apply_chat_template=False, input_template="q: {}\na: ")
    assert [tok.decode(s.tokens) for s in samples] == ["q: 1+2=\na: 3<eos>", "1+2=3<eos>"]


def test_train_sft_s_default_template_is_openrlhfs_and_gives_way_to_the_chat_template():
    """Issue 41: OpenRLHF's train_sft wraps text prompts in 'User: {}\\nAssistant: ' unless the chat template is
    applied, and so does train_sft now; with --apply_chat_template the default is not used and not refused, while
    a template the user gives with it still is."""
    from openpack.config.schema import ConfigError
    from openpack.config.sft import SFTRunConfig

    def data(*argv):
        return SFTRunConfig.parse(list(argv), "openpack train_sft", "").data

    assert data().prompt_template() == "User: {}\nAssistant: "
    assert data("--apply_chat_template").prompt_template() is None
    assert data("--input_template", "None").prompt_template() is None
    with pytest.raises(ConfigError, match="drop one of the two"):
        data("--apply_chat_template", "--input_template", "q: {}")


@pytest.mark.parametrize("template, chat, match", [
    ("q: ", False, r"--input_template 'q: ' has no \{\}"),
    ("q: {}\\na: ", False, r"--input_template .* the two characters \\n"),
    ("q: {}\na: ", True, "--input_template formats plain-text prompts.*--apply_chat_template"),
])
def test_input_template_errors(tok, template, chat, match):
    with pytest.raises(DataError, match=match):
        tokenize(tok, rows_of({"prompt": "1+2=", "response": "3"}), apply_chat_template=chat, input_template=template)


def test_unsupported_shape_lists_the_accepted_formats(tok):
    with pytest.raises(DataError) as err:
        tokenize(tok, rows_of({"text": "1+2=3"}), input_key="q", output_key="a")
    message = str(err.value)
    assert message.startswith("train.jsonl:1: ") and "['text']" in message and "--skip_bad_samples" in message
    for example in ('{"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}',
                    '{"q": "1+2=", "a": "3"}', '{"prompt": "1+2=", "completion": "3"}'):
        assert example in message
    assert all(flag in message for flag in ("--messages_key", "--input_key", "--output_key"))


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "usr", "content": "1+2="}, *assistant("3")]},
    {"prompt": [{"role": "usr", "content": "1+2="}], "completion": assistant("3")},
    {"prompt": [{"role": "usr", "content": "1+2="}], "response": "3"},
])
def test_unknown_chat_role_is_an_error_naming_the_row(tok, row):
    with pytest.raises(DataError, match=r"train.jsonl:1: .*message 0 has role 'usr'.*system, developer, user, "
                                        r"assistant, tool.*--skip_bad_samples") as err:
        tokenize(tok, rows_of(row))
    assert err.value.reason == "unknown chat role"


def test_assistant_loss_without_generation_markers_finds_the_same_turns(tok):
    """No {% generation %} markers: the turns are found by rendering prefixes (tests/unit/test_chat_masks.py), and
    the targets are the marked ones, '3<eos>' and '4<eos>'."""
    unmarked = build_demo_tokenizer()
    unmarked.chat_template = unmarked.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    samples, _ = tokenize(unmarked, rows_of({"messages": TWO_TURNS}))
    assert samples[0].tokens == PROMPT_1_PLUS_2 + [7, EOS] + SECOND_TURN + [8, EOS]
    assert samples[0].targets == [False] * 23 + [True] * 2 + [False] * 22 + [True] * 2


def test_conversation_with_no_assistant_turn_is_a_bad_row(tok):
    rows = rows_of({"messages": user("1+2=")}, {"messages": TWO_TURNS})
    with pytest.raises(DataError, match=r"train.jsonl:1: 'messages' has no assistant turn.*--conversation_loss all"):
        tokenize(tok, rows)
    samples, report = tokenize(tok, rows, skip_bad_samples=True)
    assert [s.row for s in samples] == [1] and report.skipped == Counter({"no assistant turn": 1})


def test_conversation_truncation(tok):
    """keep_start: the first --max_len tokens; a conversation whose first answer starts past them is dropped."""
    samples, report = tokenize(tok, rows_of({"messages": TWO_TURNS}), max_len=30)
    assert samples[0].tokens == (PROMPT_1_PLUS_2 + [7, EOS] + SECOND_TURN)[:30]
    assert samples[0].targets == [False] * 23 + [True] * 2 + [False] * 5 and report.truncated == 1
    rows = rows_of({"messages": TWO_TURNS}, SHORT)  # 1+2= | 3<eos> as text: 6 tokens
    samples, report = tokenize(tok, rows, max_len=23, apply_chat_template=False)
    assert [s.source for s in samples] == ["train.jsonl:2"]
    assert report.drop_reasons == Counter({"prompt fills --max_len, no response left": 1})


def test_report_summary(tok):
    """The driver's "data: ..." line: rows per format, then what --max_len and --skip_bad_samples did."""
    rows = rows_of({"messages": TWO_TURNS}, {"prompt": "1+2=", "completion": "3"}, LONG, {"q": 1}, SHORT,
                   {"prompt": "1+2=1+2=", "response": "3"})
    samples, report = tokenize(tok, rows, max_len=25, skip_bad_samples=True)
    assert report.summary(len(samples), 25, Counter({"malformed json": 2})) == (
        "4 samples from 6 rows (3 chat prompt/response, 1 chat prompt/completion, 1 conversation (messages)); "
        "2 truncated to --max_len 25; dropped: 1 prompt fills --max_len, no response left; "
        "skipped: 2 malformed json, 1 missing key 'prompt'")


# ---- parity with TRL's own SFTTrainer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_sft_for(tmp_path_factory):
    """TRL 1.16's SFTTrainer._prepare_dataset output (input_ids, labels) for the rows, each indexed as ``row``."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from openpack.models.tiny import tiny_causal_lm

    def build(tokenizer, rows, max_length, assistant_only_loss=False):
        args = SFTConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to=[],
                         max_length=max_length, dataset_num_proc=None, assistant_only_loss=assistant_only_loss)
        indexed = Dataset.from_list([{**row, "row": i} for i, row in enumerate(rows)])
        model = tiny_causal_lm("llama", vocab_size=len(tokenizer), seed=0)
        return list(SFTTrainer(model=model, args=args, train_dataset=indexed, processing_class=tokenizer).train_dataset)

    return build


def assert_trl_sft_parity(tokenizer, trl_sft_for, trl_rows, max_length, ours_rows=None, assistant_only_loss=False,
                          **ours):
    """Same kept rows, same input_ids, and our targets == TRL's labels != -100, token for token."""
    trl_examples = trl_sft_for(tokenizer, trl_rows, max_length, assistant_only_loss)
    settings = dict(input_key="prompt", output_key="completion", apply_chat_template=False, max_len=max_length,
                    conversation_loss="assistant" if assistant_only_loss else "all")
    samples, report = tokenize_sft(rows_of(*(ours_rows or trl_rows)), tokenizer, **{**settings, **ours})
    assert [s.row for s in samples] == [ex["row"] for ex in trl_examples]
    for ex, sample in zip(trl_examples, samples):
        assert sample.tokens == ex["input_ids"]
        assert sample.targets == [label != -100 for label in ex["labels"]]
    return report


CONVERSATIONS = [  # demo template: 25 tokens per answered turn of a 1-digit sum
    TWO_TURNS,
    [{"role": "system", "content": "be brief"}, *user("x"), *assistant("yes")],
    user("count") + assistant("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"),  # 25 + 36 tokens: cut at 40
    user("hi") + assistant("hello") + user("bye") + assistant(""),  # an empty answer still trains its eos
    user("long " * 8) + assistant("a"),  # the answer starts past 40 tokens: dropped (no target left)
    [{"role": "tool", "content": "42"}, *user("ok?"), *assistant("ok")],
]


@pytest.mark.slow
@pytest.mark.parametrize("assistant_only_loss", [True, False])
def test_conversations_match_trl(tok, bpe_tok, trl_sft_for, assistant_only_loss):
    rows = [{"messages": conversation} for conversation in CONVERSATIONS]
    for tokenizer in (tok, bpe_tok):
        report = assert_trl_sft_parity(tokenizer, trl_sft_for, rows, 40, assistant_only_loss=assistant_only_loss)
        assert report.formats == Counter({"conversation (messages)": len(rows)})


TEXT_PAIRS = [
    ("1+2=", "3"),
    ("9+0=", "9<eos>"),  # eos already there: not doubled
    ("ab<eo", "s>x"),  # the prompt's tail merges into '<eos>'
    ("x<bos>y", "z"),
    ("User: 1+2=\nAssistant: ", "3"),  # BPE: 'Ġ' + '3' merge into 'Ġ3'
    ("the sky is", " blue"),
    ("5+5=", "1" * 20),  # cut at 16
    ("p" * 15, "yes"),  # one completion token survives
    ("p" * 16, "yes"),  # the prompt fills max_length: dropped
]


@pytest.mark.slow
def test_text_prompt_completion_matches_trl(tok, bpe_tok, trl_sft_for):
    from tokenizers.processors import TemplateProcessing

    bos_tok = build_demo_tokenizer()  # adds <bos> to encoded text, as Llama's does; TRL tokenizes text with it
    bos_tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    rows = [{"prompt": p, "completion": c} for p, c in TEXT_PAIRS]
    for tokenizer, max_length in ((tok, 16), (bos_tok, 17), (bpe_tok, 16)):
        report = assert_trl_sft_parity(tokenizer, trl_sft_for, rows, max_length)
        assert report.formats == Counter({"text prompt/completion": len(rows)})


CHAT_PAIRS = [
    (user("1+2="), assistant("3")),
    (user("hi") + assistant("hello") + user("2+2="), assistant("4")),
    ([{"role": "system", "content": "be brief"}, *user("x")], assistant("y")),
    (user("count"), assistant("1 2 3 4 5 6 7 8 9 10 11 12")),  # cut at 40
    (user("long " * 8), assistant("a")),  # the prompt fills 40 tokens: dropped
]


@pytest.mark.slow
def test_chat_prompt_completion_matches_trl(tok, bpe_tok, trl_sft_for):
    rows = [{"prompt": p, "completion": c} for p, c in CHAT_PAIRS]
    for tokenizer in (tok, bpe_tok):
        assert_trl_sft_parity(tokenizer, trl_sft_for, rows, 40)


@pytest.mark.slow
def test_openrlhf_keys_match_trl(tok, bpe_tok, trl_sft_for):
    """--input_key/--output_key rows: with --apply_chat_template the text becomes a user and an assistant turn
    (TRL's conversational prompt/completion); with --input_template the prompt is formatted first."""
    plain = [{"question": p, "answer": c} for p, c in (("1+2=", "3"), ("what is 1+2?", "3"), ("hi", "yes"))]
    keys = dict(input_key="question", output_key="answer")
    for tokenizer in (tok, bpe_tok):
        chat = [{"prompt": user(r["question"]), "completion": assistant(r["answer"])} for r in plain]
        report = assert_trl_sft_parity(tokenizer, trl_sft_for, chat, 64, plain, apply_chat_template=True, **keys)
        assert report.formats == Counter({"chat question/answer": 3})
        template = "User: {}\nAssistant: "
        formatted = [{"prompt": template.format(r["question"]), "completion": r["answer"]} for r in plain]
        assert_trl_sft_parity(tokenizer, trl_sft_for, formatted, 64, plain, input_template=template, **keys)


def test_flags_reach_the_tokenizer(tok):
    """--messages_key, --conversation_loss and --input_template parse into DataConfig and reach tokenize_sft, as a
    rank calls it (the driver's pass reads the same SFTTokenization, ``sft_worker.tokenization``)."""
    from openpack.config import sft
    from openpack.config.schema import parse_config
    from openpack.trainers.sft_worker import _tokenize

    def data_config(*flags):
        return parse_config(["--pretrain", "m", "--dataset", "d.jsonl", *flags], "t", "", *sft.CONFIGS)[1]

    samples = _tokenize(rows_of({"chat": TWO_TURNS}), tok, data_config("--messages_key", "chat",
                                                                       "--conversation_loss", "all"))
    assert samples[0].targets == [True] * 49
    samples = _tokenize(rows_of(SHORT), tok, data_config("--input_template", "q: {}\na: "))
    assert tok.decode(samples[0].tokens) == "q: 1+2=\na: 3<eos>"


def test_every_row_in_the_docs_table_trains_on_its_answer(tok):
    """docs/sft.md's table of formats: each one-row example is read, and only '3<eos>' is trained on."""
    import json
    import re
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "sft.md").read_text()
    table = docs[docs.index("| format | one row | trained on |"):].split("\n\n")[0]
    examples = [json.loads(row) for row in re.findall(r"^\| [^|]+ \| `(\{.*?\})` \|", table, re.M)]
    assert len(examples) == 4
    samples, report = tokenize(tok, rows_of(*examples), apply_chat_template=False)
    assert sum(report.formats.values()) == 4 and len(samples) == 4
    for sample in samples:
        assert tok.decode([t for t, target in zip(sample.tokens, sample.targets) if target]) == "3<eos>"
