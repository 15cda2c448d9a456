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


def test_template_that_does_not_extend_the_prompt_is_a_bad_row(tok):
    odd = build_demo_tokenizer()
    # The generation prompt says "assistant: " but the answer turn says "bot: ".
    odd.chat_template = odd.chat_template.replace("'assistant: ' }}{% generation", "'bot: ' }}{% generation")
    rows = rows_of({"prompt": "1+2=", "response": "3"})
    with pytest.raises(DataError, match="does not start with"):
        tokenize(odd, rows)
    with pytest.raises(DataError, match="no SFT samples left"):
        tokenize(odd, rows, skip_bad_samples=True)


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
