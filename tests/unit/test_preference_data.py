"""tokenize_pairs: exact tokens with the demo tokenizer, parity with TRL 1.16's DPOTrainer, bad rows, length policies.

Demo vocabulary (openpack/data/demo_tokenizer.py): <pad> <bos> <eos> <unk> are
0-3, digits '0'-'9' are 4-13, 'a'-'z' are 14-39, then ' ' 40, '\\n' 41, '+' 42,
'-' 43, '=' 44, ':' 45. So "1+2=" is 5 42 6 44, "3" is 7, "4" is 8. Encoding
adds no special tokens; "<eos>" in text is the eos token (2).
"""

from collections import Counter

import pytest

from openpack.core.batch import CHOSEN, REJECTED, Segment
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import DataError, Rows
from openpack.data.preference import PreferencePair, PreferenceReport, tokenize_pairs

BOS, EOS, UNK = 1, 2, 3
ONE_PLUS_TWO = [5, 42, 6, 44]
# <bos>user: 1+2=\nassistant: (the demo chat template with the generation prompt), 23 tokens
CHAT_PROMPT = [BOS, 34, 32, 18, 31, 45, 40, *ONE_PLUS_TWO, 41, 14, 32, 32, 22, 32, 33, 14, 27, 33, 45, 40]
THREE_CHOICES = ("truncate", "drop", "error")


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def rows_of(*rows):
    return Rows(list(rows), [f"train.jsonl:{i + 1}" for i in range(len(rows))])


def pair_row(prompt="1+2=", chosen="3", rejected="4"):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


# ---- exact tokens -------------------------------------------------------------------------------------------------


def test_pair_tokens_and_segments_literal(tok):
    """1+2= | 3<eos> vs 1+2= | 4<eos>: 4 prompt tokens (not targets), then the answer and eos (targets)."""
    pairs, report = tokenize_pairs(rows_of(pair_row()), tok)
    assert pairs == [PreferencePair(ONE_PLUS_TWO, [7, EOS], [8, EOS], "train.jsonl:1")]
    assert pairs[0].lengths() == (6, 6)
    chosen, rejected = pairs[0].segments(sample_index=7)
    assert chosen == Segment([5, 42, 6, 44, 7, EOS], [False] * 4 + [True] * 2, 7, CHOSEN)
    assert rejected == Segment([5, 42, 6, 44, 8, EOS], [False] * 4 + [True] * 2, 7, REJECTED)
    assert tok.decode(chosen.tokens) == "1+2=" + "3" + tok.eos_token  # the oracle without TRL
    assert report == PreferenceReport(truncated=0, dropped=0, skipped=Counter(), drop_reasons=Counter())


def test_eos_is_not_appended_twice(tok):
    pairs, _ = tokenize_pairs(rows_of(pair_row(chosen="3<eos>", rejected="45")), tok)
    assert (pairs[0].chosen, pairs[0].rejected) == ([7, EOS], [8, 9, EOS])


def test_conversational_pair_uses_the_chat_template(tok):
    """The template writes <bos> and eos; nothing is appended and no special token is added twice."""
    row = {"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("4")}
    pairs, _ = tokenize_pairs(rows_of(row), tok)
    assert pairs == [PreferencePair(CHAT_PROMPT, [7, EOS], [8, EOS], "train.jsonl:1")]


def test_custom_keys(tok):
    rows = rows_of({"q": "1+2=", "good": "3", "bad": "4"})
    pairs, _ = tokenize_pairs(rows, tok, prompt_key="q", chosen_key="good", rejected_key="bad")
    assert pairs[0].chosen == [7, EOS]


def test_prompt_tail_merged_into_the_completion_is_left_out(tok):
    """'ab<eo' + 's>x' reads '<eos>' as one token, so the prompt's '<eo' is not a prefix: cut where they diverge."""
    pairs, _ = tokenize_pairs(rows_of(pair_row("ab<eo", "s>x", "t")), tok)
    assert pairs == [PreferencePair([14, 15], [EOS, 37, EOS], [UNK, 18, 28, 33, EOS], "train.jsonl:1")]


# ---- parity with TRL's own DPOTrainer -----------------------------------------------------------------------------

TRL_MAX_LENGTH = 16
PLAIN_ROWS = [
    pair_row("1+2=", "3", "4"),
    pair_row("07+35=", "42", "43"),
    pair_row("9+0=", "9<eos>", "8"),  # eos already there: not doubled
    pair_row("5+5=", "10<eos>", "11<eos>"),
    pair_row("12+0=", "12", "123"),  # chosen is a prefix of rejected
    pair_row("q: what is one\n", "one", "two"),  # 15 prompt tokens: both completions cut to 1
    pair_row("a b ", "c", "d"),  # trailing space in the prompt
    pair_row("Hi ", "Yo", "no"),  # upper case is <unk>
    pair_row("x<bos>y", "z", "w"),  # a special token inside the text
    pair_row("e: ", "a<eos>b", "ab"),  # eos inside a completion
    pair_row("5+5=", "1" * 20, "222"),  # prompt+chosen over 16: its end is cut, rejected kept whole
    pair_row("7+7=", "3" * 14, "4" * 13),  # both over 16: both cut
    pair_row("p" * 15, "yes", "no"),  # cut: one completion token survives
    pair_row("p" * 16, "yes", "no"),  # prompt fills max_length: TRL drops it
    pair_row("long prompt " * 3, "a", "b"),  # prompt over max_length: dropped
    pair_row("line one\nline two\n", "yes", "no"),  # 18-token prompt: dropped
    pair_row("+-=: ", "=", "-"),
    pair_row("k: ", "k<eos", "k<eo"),  # a partial eos is text
    pair_row("ab<eo", "s>x", "t"),  # prompt tail merges into '<eos>'
    pair_row("3+3=", "6", "6 "),  # differ by one space
    pair_row("99+99=", "198", "189"),
]
CHAT_MAX_LENGTH = 50
CHAT_ROWS = [  # templated prompt lengths 23, 49, 37, 24, 59
    {"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("4")},
    # multi-turn prompt; both sides 51 tokens: cut to one completion token
    {"prompt": user("hi") + assistant("hello") + user("2+2="), "chosen": assistant("4"), "rejected": assistant("5")},
    {"prompt": [{"role": "system", "content": "be brief"}, *user("x")], "chosen": assistant("y"),
     "rejected": assistant("zz")},
    # chosen side 24 + 33 tokens: cut
    {"prompt": user("count"), "chosen": assistant("1 2 3 4 5 6 7 8 9 10 11 12"), "rejected": assistant("1 2")},
    {"prompt": user("long " * 8), "chosen": assistant("a"), "rejected": assistant("b")},  # prompt over 50: dropped
]


@pytest.fixture(scope="module")
def bos_tok():
    """The demo tokenizer adding <bos> to encoded text, as Llama's does: TRL tokenizes plain text with special tokens."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_demo_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    return tokenizer


@pytest.fixture(scope="module")
def trl_trainer_for(tmp_path_factory):
    """Build a tiny DPOTrainer on CPU and return its processed train_dataset and collator (~1 s each; TRL import ~10 s)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from openpack.models.tiny import tiny_causal_lm

    def build(tok, rows, max_length):
        args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to=[],
                         max_length=max_length, dataset_num_proc=None)
        indexed = Dataset.from_list([{**row, "row": i} for i, row in enumerate(rows)])
        model, ref = (tiny_causal_lm("llama", vocab_size=len(tok), seed=s) for s in (0, 1))
        trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=indexed, processing_class=tok)
        return list(trainer.train_dataset), trainer.data_collator

    return build


def assert_trl_parity(tok, trl_trainer_for, rows, max_length, ours_rows=None, **ours):
    """TRL's rows ``rows``; ours ``ours_rows`` (default the same) tokenized with the flags ``ours``.

    The same rows survive TRL's filter, except the pairs truncation makes identical: TRL keeps them, we drop
    and count them (``_fit_length``).
    """
    trl_examples, collate = trl_trainer_for(tok, rows, max_length)
    ours_rows = rows_of(*(ours_rows or rows))
    pairs, report = tokenize_pairs(ours_rows, tok, max_len=max_length, overlength="truncate", **ours)
    untruncated, _ = tokenize_pairs(ours_rows, tok, max_len=10**6, **ours)
    by_row, identical = {pair.row: pair for pair in pairs}, 0
    for ex in trl_examples:
        full = untruncated[ex["row"]]
        assert (full.prompt, full.chosen, full.rejected) == (ex["prompt_ids"], ex["chosen_ids"], ex["rejected_ids"])
        batch = collate([ex])  # rows: [prompt+chosen, prompt+rejected], right-padded, truncated
        sequences = [batch["input_ids"][row, :int(batch["attention_mask"][row].sum())].tolist() for row in (0, 1)]
        if ex["row"] not in by_row:
            assert sequences[0] == sequences[1]  # identical after the cut: TRL trains on it, we dropped it
            identical += 1
            continue
        for row, segment in enumerate(by_row[ex["row"]].segments(0)):
            assert sequences[row] == list(segment.tokens)
            assert batch["completion_mask"][row, :len(sequences[row])].bool().tolist() == list(segment.targets)
    kept = [ex["row"] for ex in trl_examples]
    assert sorted(by_row) == [row for row in kept if row in by_row] and len(by_row) == len(kept) - identical
    expected = Counter({"prompt fills --max_len, no response left": len(rows) - len(kept),
                        "identical after truncation to --max_len": identical})
    assert report.drop_reasons == +expected
    return report


@pytest.mark.slow
def test_plain_text_matches_trl_dpo_trainer(tok, trl_trainer_for):
    """Ids before truncation equal TRL's processed dataset; after, equal its collator's sequences and loss masks."""
    report = assert_trl_parity(tok, trl_trainer_for, PLAIN_ROWS, TRL_MAX_LENGTH)
    assert (report.truncated, report.dropped) == (4, 3)  # the rows commented "cut" and "dropped" above


@pytest.mark.slow
def test_plain_text_with_bos_matches_trl_dpo_trainer(bos_tok, trl_trainer_for):
    report = assert_trl_parity(bos_tok, trl_trainer_for, PLAIN_ROWS, TRL_MAX_LENGTH + 1)  # +1 for <bos>
    assert (report.truncated, report.dropped) == (4, 3)
    pairs, _ = tokenize_pairs(rows_of(pair_row()), bos_tok)
    assert pairs[0] == PreferencePair([BOS, *ONE_PLUS_TWO], [7, EOS], [8, EOS], "train.jsonl:1")


@pytest.mark.slow
def test_chat_messages_match_trl_dpo_trainer(tok, trl_trainer_for):
    report = assert_trl_parity(tok, trl_trainer_for, CHAT_ROWS, CHAT_MAX_LENGTH)  # the template writes <bos>
    assert (report.truncated, report.dropped) == (2, 1)


# ---- bad rows -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prompt", "chosen", "rejected"])
def test_missing_field_names_row_key_and_flag(tok, name):
    row = pair_row()
    del row[name]
    with pytest.raises(DataError, match=rf"train.jsonl:1: no key '{name}'.*--{name}_key.*--skip_bad_samples") as err:
        tokenize_pairs(rows_of(row), tok)
    assert err.value.reason == f"missing key '{name}'"


@pytest.mark.parametrize("empty", ["", "  \n", []])
@pytest.mark.parametrize("name", ["prompt", "chosen", "rejected"])
def test_empty_field(tok, name, empty):
    with pytest.raises(DataError, match=rf"train.jsonl:1: '{name}' .*--{name}_key\) is empty") as err:
        tokenize_pairs(rows_of({**pair_row(), name: empty}), tok)
    assert err.value.reason == f"empty '{name}'"


@pytest.mark.parametrize("value", [5, None, {"text": "3"}, ["3"], [{"content": "no role"}]])
@pytest.mark.parametrize("name", ["prompt", "chosen", "rejected"])
def test_non_string_field(tok, name, value):
    with pytest.raises(DataError, match=rf"train.jsonl:1: '{name}' is a .*expected a string.*--{name}_key") as err:
        tokenize_pairs(rows_of({**pair_row(), name: value}), tok)
    assert err.value.reason == f"non-string '{name}'"


def test_text_mixed_with_messages(tok):
    row = {"prompt": user("1+2="), "chosen": "3", "rejected": assistant("4")}
    with pytest.raises(DataError, match=r"train.jsonl:1: 'prompt' is messages, 'chosen' is text.*all three") as err:
        tokenize_pairs(rows_of(row), tok)
    assert err.value.reason == "text mixed with messages"


@pytest.mark.parametrize("chosen, rejected", [("3", "3"), ("3", "3<eos>"), (assistant("3"), assistant("3"))])
def test_chosen_same_as_rejected_is_nothing_to_prefer(tok, chosen, rejected):
    prompt = user("1+2=") if isinstance(chosen, list) else "1+2="
    with pytest.raises(DataError, match=r"train.jsonl:1: 'chosen' and 'rejected' give the same .*nothing to prefer"):
        tokenize_pairs(rows_of(pair_row(prompt, chosen, rejected)), tok)


def test_messages_need_a_chat_template(tok):
    plain = build_demo_tokenizer()
    plain.chat_template = None
    row = {"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("4")}
    with pytest.raises(DataError, match="no chat template") as err:
        tokenize_pairs(rows_of(row), plain, skip_bad_samples=True)  # a tokenizer problem: never skipped
    assert err.value.reason is None


def test_plain_text_needs_an_eos_token():
    no_eos = build_demo_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(DataError, match="no eos_token"):
        tokenize_pairs(rows_of(pair_row()), no_eos, skip_bad_samples=True)


def test_skip_bad_samples_counts_each_reason(tok):
    rows = rows_of(
        pair_row(),
        {"prompt": "1+2=", "chosen": "3"},
        pair_row(chosen=""),
        pair_row(rejected=7),
        pair_row(chosen="3", rejected="3"),
        {"prompt": user("1+2="), "chosen": "3", "rejected": "4"},
        pair_row("2+2=", "4", "5"),
    )
    pairs, report = tokenize_pairs(rows, tok, skip_bad_samples=True)
    assert [p.source for p in pairs] == ["train.jsonl:1", "train.jsonl:7"]
    assert [p.row for p in pairs] == [0, 6]  # the driver's pair -> row map that ranks re-tokenize from
    assert report.skipped == Counter({
        "missing key 'rejected'": 1, "empty 'chosen'": 1, "non-string 'rejected'": 1,
        "chosen same as rejected": 1, "text mixed with messages": 1,
    })
    assert (report.truncated, report.dropped) == (0, 0)


def test_nothing_left_names_the_counts(tok):
    rows = rows_of(pair_row(chosen="3", rejected="3"), {"q": "1+2="}, pair_row("x" * 9, "3", "4"))
    with pytest.raises(DataError, match=r"no preference pairs left from 3 rows: 1 dropped and 2 skipped") as err:
        tokenize_pairs(rows, tok, max_len=8, skip_bad_samples=True)
    assert "--prompt_key/--chosen_key/--rejected_key" in str(err.value) and "--max_len (now 8)" in str(err.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(overlength="cut"), "--overlength_policy must be one of truncate, drop, error"),
    (dict(max_len=1), "--max_len must be an integer >= 2"),
])
def test_bad_arguments(tok, kwargs, match):
    with pytest.raises(DataError, match=match):
        tokenize_pairs(rows_of(pair_row()), tok, **kwargs)


# ---- over-length policies -----------------------------------------------------------------------------------------

# 1+2= | 345<eos> (8 tokens) vs 1+2= | 4<eos> (6 tokens), with --max_len 6
LONG_CHOSEN = pair_row(chosen="345")


def test_truncate_cuts_the_end_of_the_long_completion_only(tok):
    """TRL's keep_start: (prompt + completion)[:max_len] per sequence; the prompt and the short side stay whole."""
    pairs, report = tokenize_pairs(rows_of(LONG_CHOSEN, pair_row()), tok, max_len=6, overlength="truncate")
    assert pairs[0] == PreferencePair(ONE_PLUS_TWO, [7, 8], [8, EOS], "train.jsonl:1")  # eos of chosen cut
    assert pairs[1] == PreferencePair(ONE_PLUS_TWO, [7, EOS], [8, EOS], "train.jsonl:2")
    assert (report.truncated, report.dropped) == (1, 0)


def test_drop_counts_pairs_with_either_side_over(tok):
    rows = rows_of(LONG_CHOSEN, pair_row(rejected="456"), pair_row())
    pairs, report = tokenize_pairs(rows, tok, max_len=6, overlength="drop")
    assert [p.source for p in pairs] == ["train.jsonl:3"]
    assert (report.truncated, report.dropped, report.drop_reasons) == (0, 2, Counter({"over --max_len": 2}))


def test_error_names_row_length_flag_and_choices(tok):
    with pytest.raises(DataError) as err:
        tokenize_pairs(rows_of(pair_row(), LONG_CHOSEN), tok, max_len=6, overlength="error")
    message = str(err.value)
    assert message.startswith("train.jsonl:2: prompt+chosen is 8 tokens (4 prompt + 4 chosen), over --max_len 6")
    assert all(word in message for word in ("--overlength_policy", *THREE_CHOICES))


@pytest.mark.parametrize("overlength", ["truncate", "drop"])
def test_prompt_that_fills_max_len_is_dropped_and_counted(tok, overlength):
    rows = rows_of(pair_row("1+2=" * 2), pair_row())  # an 8-token prompt, then a 6-token pair
    pairs, report = tokenize_pairs(rows, tok, max_len=8, overlength=overlength)
    assert [p.source for p in pairs] == ["train.jsonl:2"]
    assert (report.dropped, report.drop_reasons) == (1, Counter({"prompt fills --max_len, no response left": 1}))


def test_prompt_that_fills_max_len_is_an_error_under_error(tok):
    with pytest.raises(DataError, match=r"train.jsonl:1: the prompt alone is 8 tokens, >= --max_len 8, so there is "
                                        r"no room for a response; raise --max_len.*truncate.*drop.*error"):
        tokenize_pairs(rows_of(pair_row("1+2=" * 2)), tok, max_len=8, overlength="error")


# ---- formats: TRL's implicit prompt, --apply_chat_template, OpenRLHF's --input_template ------------------------------


def test_implicit_prompt_conversation(tok):
    """No 'prompt' key: the leading turns chosen and rejected share are the prompt (TRL's extract_prompt)."""
    row = {"chosen": user("1+2=") + assistant("3"), "rejected": user("1+2=") + assistant("4")}
    pairs, report = tokenize_pairs(rows_of(row), tok)
    assert pairs == [PreferencePair(CHAT_PROMPT, [7, EOS], [8, EOS], "train.jsonl:1")]
    assert report.formats == Counter({"chat chosen/rejected (implicit prompt)": 1})


def test_implicit_prompt_text(tok):
    """The shared characters are the prompt, less a trailing space (TRL's rule): '1+2=' | ' 3<eos>' vs ' 4<eos>'."""
    pairs, report = tokenize_pairs(rows_of({"chosen": "1+2= 3", "rejected": "1+2= 4"}), tok)
    assert pairs == [PreferencePair(ONE_PLUS_TWO, [40, 7, EOS], [40, 8, EOS], "train.jsonl:1")]
    assert report.formats == Counter({"text chosen/rejected (implicit prompt)": 1})


@pytest.mark.parametrize("chosen, rejected, why", [
    ("3", "4", "share no start"),
    ("1+2=3", "1+2=34", "one is the start of the other"),
    (user("1+2=") + assistant("3"), user("2+2=") + assistant("4"), "share no start"),
    (user("1+2=") + assistant("3"), user("1+2=") + assistant("3"), "one is the start of the other"),
])
def test_implicit_prompt_that_cannot_be_found(tok, chosen, rejected, why):
    with pytest.raises(DataError, match=rf"train.jsonl:1: no key 'prompt' \(--prompt_key\).*{why}") as err:
        tokenize_pairs(rows_of({"chosen": chosen, "rejected": rejected}), tok)
    assert err.value.reason == "missing key 'prompt'"
    for example in ('{"prompt": "1+2=", "chosen": "3", "rejected": "4"}', '{"chosen": [{"role": "user"'):
        assert example in str(err.value)


def test_apply_chat_template_makes_text_user_and_assistant_turns(tok):
    pairs, report = tokenize_pairs(rows_of(pair_row()), tok, apply_chat_template=True)
    assert pairs == [PreferencePair(CHAT_PROMPT, [7, EOS], [8, EOS], "train.jsonl:1")]
    assert report.formats == Counter({"chat prompt/chosen/rejected": 1})


def test_input_template_formats_text_prompts(tok):
    pairs, _ = tokenize_pairs(rows_of(pair_row()), tok, input_template="q: {}\na: ")
    assert tok.decode(pairs[0].prompt) == "q: 1+2=\na: " and pairs[0].chosen == [7, EOS]


@pytest.mark.parametrize("template, chat, match", [
    ("q: ", False, r"--input_template 'q: ' has no \{\}"),
    ("q: {}\na: ", True, "--input_template formats plain-text prompts.*--apply_chat_template"),
])
def test_input_template_errors(tok, template, chat, match):
    with pytest.raises(DataError, match=match):
        tokenize_pairs(rows_of(pair_row()), tok, apply_chat_template=chat, input_template=template)


@pytest.mark.parametrize("name", ["prompt", "chosen", "rejected"])
def test_unknown_chat_role_is_an_error_naming_the_row(tok, name):
    row = {"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("4")}
    row[name] = [{"role": "bot", "content": "5"}]
    with pytest.raises(DataError, match=rf"train.jsonl:1: '{name}' message 0 has role 'bot'.*system, developer, user, "
                                        r"assistant, tool.*--skip_bad_samples") as err:
        tokenize_pairs(rows_of(row), tok)
    assert err.value.reason == "unknown chat role"


def test_missing_chosen_lists_the_accepted_formats(tok):
    with pytest.raises(DataError) as err:
        tokenize_pairs(rows_of({"prompt": "1+2=", "answer": "3"}), tok)
    message = str(err.value)
    assert message.startswith("train.jsonl:1: no key 'chosen'") and "implicit prompt" in message
    assert '{"prompt": "1+2=", "chosen": "3", "rejected": "4"}' in message


def test_pairs_identical_after_truncation_are_dropped_and_counted(tok):
    """1+2= | 345<eos> vs 1+2= | 346<eos> at --max_len 6: both become 1+2= | 34, nothing to prefer (TRL keeps it)."""
    rows = rows_of(pair_row(chosen="345", rejected="346"), pair_row())
    pairs, report = tokenize_pairs(rows, tok, max_len=6)
    assert [p.source for p in pairs] == ["train.jsonl:2"]
    assert (report.truncated, report.dropped) == (0, 1)
    assert report.drop_reasons == Counter({"identical after truncation to --max_len": 1})
    assert report.summary(len(pairs), 6, Counter()) == (
        "1 pair from 2 rows (2 text prompt/chosen/rejected); 0 truncated to --max_len 6; "
        "dropped: 1 identical after truncation to --max_len; skipped: none")


@pytest.mark.slow
def test_pairs_identical_after_truncation_are_what_trl_keeps(tok, trl_trainer_for):
    """16 tokens: a 4-token prompt leaves 12; the first pair parts at its 15th completion token, the second at its
    12th (cut, still different)."""
    rows = [pair_row("7+7=", "3" * 14 + "1", "3" * 14 + "2"), pair_row("7+7=", "3" * 11 + "1", "3" * 11 + "2"),
            pair_row()]
    report = assert_trl_parity(tok, trl_trainer_for, rows, TRL_MAX_LENGTH)
    assert report.drop_reasons == Counter({"identical after truncation to --max_len": 1}) and report.truncated == 1


IMPLICIT_TEXT_ROWS = [
    {"chosen": "1+2= 3", "rejected": "1+2= 4"},
    {"chosen": "q: abc", "rejected": "q: abd"},
    {"chosen": "the sky is blue", "rejected": "the sky is green"},
    {"chosen": "5+5=" + "1" * 20, "rejected": "5+5=2"},  # cut at 16
    {"chosen": "p" * 16 + "a", "rejected": "p" * 16 + "b"},  # the prompt fills 16 tokens: dropped
]
IMPLICIT_CHAT_ROWS = [
    {"chosen": user("1+2=") + assistant("3"), "rejected": user("1+2=") + assistant("4")},
    {"chosen": user("hi") + assistant("hello") + user("2+2=") + assistant("4"),
     "rejected": user("hi") + assistant("hello") + user("2+2=") + assistant("5")},
    {"chosen": user("x") + assistant("a") + user("y") + assistant("b"),
     "rejected": user("x") + assistant("c")},  # they part at the first answer
    {"chosen": user("long " * 8) + assistant("a"), "rejected": user("long " * 8) + assistant("b")},  # dropped
]


@pytest.mark.slow
def test_implicit_prompt_matches_trl(tok, bpe_tok, trl_trainer_for):
    for tokenizer in (tok, bpe_tok):
        report = assert_trl_parity(tokenizer, trl_trainer_for, IMPLICIT_TEXT_ROWS, TRL_MAX_LENGTH)
        assert report.formats == Counter({"text chosen/rejected (implicit prompt)": len(IMPLICIT_TEXT_ROWS)})
        report = assert_trl_parity(tokenizer, trl_trainer_for, IMPLICIT_CHAT_ROWS, CHAT_MAX_LENGTH)
        assert report.formats == Counter({"chat chosen/rejected (implicit prompt)": len(IMPLICIT_CHAT_ROWS)})


OPENRLHF_ROWS = [pair_row("1+2=", "3", "4"), pair_row("what is 1+2?", "3", "4 5"), pair_row("hi", "yes", "no")]


@pytest.mark.slow
def test_apply_chat_template_and_input_template_match_trl(tok, bpe_tok, trl_trainer_for):
    """Text rows with --apply_chat_template == TRL's conversational rows; --input_template == TRL's rows with the
    prompt formatted first (OpenRLHF formats, then tokenizes)."""
    template = "User: {}\nAssistant: "
    chat = [{"prompt": user(r["prompt"]), "chosen": assistant(r["chosen"]), "rejected": assistant(r["rejected"])}
            for r in OPENRLHF_ROWS]
    formatted = [{**r, "prompt": template.format(r["prompt"])} for r in OPENRLHF_ROWS]
    for tokenizer in (tok, bpe_tok):
        assert_trl_parity(tokenizer, trl_trainer_for, chat, CHAT_MAX_LENGTH, OPENRLHF_ROWS, apply_chat_template=True)
        assert_trl_parity(tokenizer, trl_trainer_for, formatted, CHAT_MAX_LENGTH, OPENRLHF_ROWS,
                          input_template=template)


def test_flags_reach_the_tokenizer(tok):
    """--apply_chat_template and --input_template parse into PreferenceDataConfig and reach tokenize_pairs."""
    from openpack.config import dpo
    from openpack.config.schema import parse_config
    from openpack.trainers.dpo_worker import tokenization, tokenize_pair_rows

    def data_config(*flags):
        return parse_config(["--pretrain", "m", "--dataset", "d.jsonl", *flags], "t", "", *dpo.CONFIGS)[1]

    pairs = tokenize_pair_rows(rows_of(pair_row()), tok, tokenization(data_config("--apply_chat_template")))
    assert pairs[0].prompt == CHAT_PROMPT
    how = tokenization(data_config("--input_template", "q: {}\na: "))
    pairs = tokenize_pair_rows(rows_of(pair_row()), tok, how)
    assert tok.decode(pairs[0].prompt) == "q: 1+2=\na: "


def test_every_row_in_the_docs_table_prefers_3_to_4(tok):
    """docs/dpo.md's table of formats: each one-row example is read, with '3' chosen and '4' rejected."""
    import json
    import re
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "dpo.md").read_text()
    table = docs[docs.index("| format | one row |"):].split("\n\n")[0]
    examples = [json.loads(row) for row in re.findall(r"^\| [^|]+ \| `(\{.*?\})` \|", table, re.M)]
    assert len(examples) == 4
    pairs, report = tokenize_pairs(rows_of(*examples), tok)
    assert len(pairs) == 4 and len(report.formats) == 4
    for pair in pairs:
        assert (tok.decode(pair.chosen).strip(), tok.decode(pair.rejected).strip()) == ("3<eos>", "4<eos>")
    assert tok.decode(pairs[3].prompt) == "1+2=" and tok.decode(pairs[3].chosen) == " 3<eos>"
    as_chat, _ = tokenize_pairs(rows_of(examples[0]), tok, apply_chat_template=True)
    same = [(p.prompt, p.chosen, p.rejected) for p in (as_chat[0], pairs[1])]
    assert same[0] == same[1]  # "the first row of the table then trains exactly as the second"
