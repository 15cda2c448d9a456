"""The demo task (determinism, held-out split, correct answers, pairs) and its character tokenizer."""

import json
import re

import pytest

from openpack.data.demo_task import (WORDY_FORM, answer_rates, demo_preference_pairs, demo_samples, exact_match,
                                     write_jsonl)
from openpack.data.demo_tokenizer import build_demo_tokenizer

PROMPT = re.compile(r"^(\d\d)\+(\d\d)=$")
N_PROBLEMS = 100 * 100


def operands(prompt):
    match = PROMPT.match(prompt)
    assert match, prompt
    return int(match[1]), int(match[2])


@pytest.fixture(scope="module")
def tokenizer():
    return build_demo_tokenizer()


def test_same_arguments_same_samples():
    assert demo_samples("train", 300, seed=3) == demo_samples("train", 300, seed=3)
    assert demo_samples("train", 300, seed=3) != demo_samples("train", 300, seed=4)
    assert demo_samples("train", 50, seed=3) == demo_samples("train", 300, seed=3)[:50]  # n only truncates
    assert demo_preference_pairs("test", 100, seed=1) == demo_preference_pairs("test", 100, seed=1)


def test_train_and_test_are_disjoint_and_cover_every_problem():
    # 20,000 draws cycle through each split at least twice, so these are the whole splits.
    train = {s["prompt"] for s in demo_samples("train", 20_000, seed=0)}
    test = {s["prompt"] for s in demo_samples("test", 20_000, seed=5)}
    assert not train & test
    assert len(train) + len(test) == N_PROBLEMS
    assert 0.07 < len(test) / N_PROBLEMS < 0.13  # about 1 in 10 held out
    assert {s["prompt"] for s in demo_samples("test", 20_000, seed=9)} == test  # the split ignores the seed


def test_one_epoch_has_no_repeats():
    test_size = len({s["prompt"] for s in demo_samples("test", 20_000)})
    prompts = [s["prompt"] for s in demo_samples("test", test_size, seed=2)]
    assert len(set(prompts)) == test_size


@pytest.mark.parametrize("split", ["train", "test"])
def test_answers_are_the_sums(split):
    for sample in demo_samples(split, 3000, seed=1):
        a, b = operands(sample["prompt"])
        assert sample["response"] == str(a + b)


def test_wordy_share_of_sft_answers():
    samples = demo_samples("train", 4000, seed=1, wordy_share=0.7)
    assert [s["prompt"] for s in samples] == [s["prompt"] for s in demo_samples("train", 4000, seed=1)]
    wordy = [s for s in samples if not s["response"].isdigit()]
    assert 0.67 < len(wordy) / len(samples) < 0.73
    for sample in wordy:
        a, b = operands(sample["prompt"])
        assert sample["response"] == f"it is {a + b}"


def test_preference_pairs_choose_the_bare_right_answer():
    """Rejected: the wordy form of the right answer (half) or a bare plausible mistake (half)."""
    pairs = demo_preference_pairs("train", 3000, seed=2)
    assert [p["prompt"] for p in pairs] == [s["prompt"] for s in demo_samples("train", 3000, seed=2)]
    wordy = [p for p in pairs if not p["rejected"].isdigit()]
    assert 0.45 < len(wordy) / len(pairs) < 0.55
    for pair in pairs:
        a, b = operands(pair["prompt"])
        assert pair["chosen"] == str(a + b)
        assert pair["rejected"] != pair["chosen"]
        if pair in wordy:
            assert pair["rejected"] == WORDY_FORM.format(a + b)
        else:
            assert not (len(pair["rejected"]) > 1 and pair["rejected"][0] == "0")
    kinds = {int(p["rejected"]) - int(p["chosen"]) for p in pairs if p not in wordy}
    assert {1, -1} <= kinds and len(kinds) > 3  # off by one, swapped digits, dropped carries all occur


def test_answer_rates_count_either_form_as_right_and_only_bare_as_bare():
    right, bare = answer_rates(["42", "it is 85", "it is 151", " 7\n"], ["42", "85", "152", "7"])
    assert (right, bare) == (0.75, 0.5)


def test_preference_pair_mistakes_literal():
    """47+38=85: off by one 86/84, digits swapped 58, tens carry dropped 75."""
    from openpack.data.demo_task import _wrong_answers

    assert sorted(_wrong_answers(47, 38)) == ["58", "75", "84", "86"]
    assert sorted(_wrong_answers(0, 0)) == ["1"]  # nothing below 0, no digit to swap, no carry


def test_exact_match_literals():
    assert exact_match(["42", " 85\n", "152"], ["42", "85", "151"]) == pytest.approx(2 / 3)
    assert exact_match(["042"], ["42"]) == 0.0
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        exact_match(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="no references"):
        exact_match([], [])


def test_write_jsonl_round_trip_and_leaves_no_temp_file(tmp_path):
    rows = demo_preference_pairs("test", 5)
    path = tmp_path / "nested" / "pairs.jsonl"
    write_jsonl(rows, path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert [p.name for p in path.parent.iterdir()] == ["pairs.jsonl"]


def test_vocabulary_is_small_with_special_tokens(tokenizer):
    assert len(tokenizer) < 100
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (
        "<pad>", "<bos>", "<eos>", "<unk>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


def test_every_sample_round_trips_one_token_per_character(tokenizer):
    samples = demo_samples("train", 20_000) + demo_samples("test", 2_000)
    texts = sorted({s["prompt"] + s["response"] for s in samples})
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert [len(ids) for ids in encoded] == [len(t) for t in texts]
    assert tokenizer.unk_token_id not in {i for ids in encoded for i in ids}
    assert tokenizer.batch_decode(encoded) == texts


def test_chat_template_literal(tokenizer):
    messages = [{"role": "user", "content": "12+35="}, {"role": "assistant", "content": "47"}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert full == "<bos>user: 12+35=\nassistant: 47<eos>"
    assert prompt == "<bos>user: 12+35=\nassistant: "
    assert full == prompt + "47" + tokenizer.eos_token  # the answer follows the generation prompt
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user: 12+35=\nassistant: 47"


def test_assistant_tokens_mask_marks_answer_and_eos(tokenizer):
    messages = [{"role": "user", "content": "12+35="}, {"role": "assistant", "content": "47"}]
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.convert_ids_to_tokens(masked) == ["4", "7", "<eos>"]


def test_save_and_reload_offline(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": "user", "content": "07+35="}, {"role": "assistant", "content": "42"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    text = "<bos>user: 99+99=\nassistant: 198<eos>"
    assert reloaded.decode(reloaded(text, add_special_tokens=False)["input_ids"]) == text
