"""The driver's data (issue 45): numbers only, tokenized once and cached, equal to tokenizing in memory, and bad
rows still named by file and line, from the cache and from the parallel pass alike."""

import json
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from openpack.data import prepared
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import DataError, load_rows, open_datasets
from openpack.data.preference import PairTokenization, tokenize_pairs
from openpack.data.sft import SFTTokenization, tokenize_sft
from openpack.trainers.run import plan_ranks

MARKER = "zebra"  # a word no length, id or path holds


def sft_rows(n, start=0):
    return [{"prompt": f"{i}+{i}={MARKER} " * (1 + i % 3), "response": str(2 * i)} for i in range(start, start + n)]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def tokenizer():
    return build_demo_tokenizer()


def select(path, tokenizer, cache, how=SFTTokenization(), **kw):
    return prepared.select([path], tokenizer, how, cache_dir=cache, num_proc=1, **kw)


def write_array(path, rows):
    path.write_text(json.dumps(rows, indent=1))
    return str(path)


@pytest.mark.parametrize("name, writer", [("train.jsonl", write), ("train.json", write_array)])
def test_the_driver_holds_numbers_only(tmp_path, tokenizer, name, writer):
    """What the plan is made from, and the plans the ranks get, hold no row text: arrays of numbers, the dataset
    paths and digests (a ``.json`` array too: its elements are indexed, not parsed and held)."""
    path = writer(tmp_path / name, sft_rows(40))
    data = select(path, tokenizer, tmp_path / "cache").finish(False)
    for array in (data.rows, data.lengths, data.labels):
        assert isinstance(array, np.ndarray) and np.issubdtype(array.dtype, np.integer)
    cfg = SimpleNamespace(packing_samples=True, use_dynamic_batch=True, max_tokens_per_gpu=256, train_batch_size=8,
                          max_epochs=1, max_steps=None, seed=1, micro_train_batch_size=1)
    plans = plan_ranks(data, [path], cfg, world_size=2)
    assert MARKER.encode() not in pickle.dumps((data, plans))
    assert MARKER.encode() not in pickle.dumps(open_datasets([path]))  # the opened files: offsets, not rows
    assert MARKER in open(path).read()  # the test could fail: the rows do hold it


def test_planning_from_the_cache_equals_tokenizing_in_memory(tmp_path, tokenizer):
    """Lengths, label counts and the summary line equal ``tokenize_sft`` over ``load_rows`` (the in-memory path),
    on the first run and when read back from the cache; the second run tokenizes nothing and says so."""
    path = write(tmp_path / "train.jsonl", sft_rows(30) + [""] + sft_rows(30, start=30))  # a blank line 31
    how = SFTTokenization(max_len=12)  # some truncated, some dropped (no target left)
    samples, report = tokenize_sft(load_rows([path]), tokenizer, max_len=12)
    expected = ([[len(s.tokens)] for s in samples], [[s.segments(0)[0].num_labels] for s in samples],
                report.summary(len(samples), 12))
    first = select(path, tokenizer, tmp_path / "cache", how)
    assert "tokenized" in first.notice and "cached" in first.notice
    second = select(path, tokenizer, tmp_path / "cache", how)
    assert "read from the cache in" in second.notice and "nothing tokenized again" in second.notice
    for selection in (first, second):
        data = selection.finish(False)
        assert (data.lengths.tolist(), data.labels.tolist(), data.summary) == expected
        assert data.rows.tolist() == [s.row + (s.row >= 30) for s in samples]  # global ids skip the blank line
    assert first.finish(False).fingerprint == second.finish(False).fingerprint


def test_a_changed_file_is_tokenized_again(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", sft_rows(20))
    cache = tmp_path / "cache"
    before = select(path, tokenizer, cache).finish(False)
    entries = sorted(cache.iterdir())
    write(tmp_path / "train.jsonl", sft_rows(19) + [{"prompt": "1+1=", "response": "a much longer answer"}])
    again = select(path, tokenizer, cache)
    assert "tokenized" in again.notice and "nothing tokenized" not in again.notice
    after = again.finish(False)
    assert after.lengths[:19].tolist() == before.lengths[:19].tolist()
    assert after.lengths[19, 0] != before.lengths[19, 0] and after.fingerprint != before.fingerprint
    assert len(sorted(cache.iterdir())) == 2 * len(entries)  # a new entry; the old one is never read for it


def test_other_flags_or_tokenizer_are_other_cache_entries(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", sft_rows(10))
    cache = tmp_path / "cache"
    select(path, tokenizer, cache)
    assert "tokenized" in select(path, tokenizer, cache, SFTTokenization(max_len=8)).notice
    other = build_demo_tokenizer()
    other.chat_template = other.chat_template + " "
    assert "nothing tokenized" not in select(path, other, cache).notice
    # a mixture, a seed or --max_samples reuse the file's entry
    assert "nothing tokenized" in select(path, tokenizer, cache, max_samples=3, probs=[1.0], seed=5).notice


def bad_file(tmp_path):
    rows = sft_rows(30)
    rows[6] = "{oops"  # line 7: malformed JSON
    rows[20] = {"prompt": "1+1="}  # line 21: no response
    return write(tmp_path / "bad.jsonl", rows)


@pytest.mark.parametrize("cached", [False, True])
def test_bad_rows_are_named_by_file_and_line(tmp_path, tokenizer, cached):
    path = bad_file(tmp_path)
    cache = tmp_path / "cache"
    if cached:  # the records (counted as skipped) come from the cache; the messages are made again
        select(path, tokenizer, cache, skip_bad_samples=True)
    with pytest.raises(DataError, match="malformed JSON") as err:
        select(path, tokenizer, cache)
    assert f"{path}:7" in str(err.value)
    fixed = write(tmp_path / "fixed.jsonl", [line for i, line in enumerate(open(path).read().splitlines()) if i != 6])
    with pytest.raises(DataError, match="no key 'response'") as err:
        select(fixed, tokenizer, cache).finish(False)
    assert f"{fixed}:20" in str(err.value) and "--output_key" in str(err.value)
    data = select(path, tokenizer, cache, skip_bad_samples=True).finish(True)
    assert len(data.rows) == 28 and "skipped: 1 malformed json, 1 missing key 'response'" in data.summary


def test_the_parallel_pass_equals_one_process(tmp_path, tokenizer, monkeypatch):
    """Chunks of 25 rows on a pool of 2 processes give the records of one process, over three files, and a bad row
    deep in a file is named by its line from either."""
    monkeypatch.setattr(prepared, "CHUNK_ROWS", 25)
    monkeypatch.setattr(prepared, "PARALLEL_FROM", 50)
    rows = sft_rows(120)
    rows[101] = {"prompt": "2+2=", "response": "   "}  # line 102: an empty response
    path = write(tmp_path / "train.jsonl", rows)
    paths = [path, write(tmp_path / "more.jsonl", sft_rows(60, start=120)),  # one pool serves every file
             write_array(tmp_path / "array.json", sft_rows(60, start=180))]  # its windows carry spans, not rows
    alone = prepared.select(paths, tokenizer, SFTTokenization(), cache_dir=tmp_path / "c1", num_proc=1,
                            skip_bad_samples=True)
    pooled = prepared.select(paths, tokenizer, SFTTokenization(), cache_dir=tmp_path / "c2", num_proc=2,
                             skip_bad_samples=True)
    assert "2 processes" in pooled.notice
    assert (alone.records == pooled.records).all() and alone.strings == pooled.strings
    with pytest.raises(DataError, match="empty") as err:
        pooled.finish(False)
    assert f"{path}:102" in str(err.value)


@pytest.mark.parametrize("name, writer", [("pairs.jsonl", write), ("pairs.json", write_array)])
def test_pairs_plan_from_lengths_equal_to_tokenize_pairs(tmp_path, tokenizer, name, writer):
    """DPO/RM pairs take the same pass: 2 segments (3 with --prefix_sharing) per pair, equal to the in-memory
    tokenization's segments; from JSONL or a ``.json`` array alike."""
    rows = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1) * (1 + i % 2)} for i in range(12)]
    path = writer(tmp_path / name, rows)
    pairs, _ = tokenize_pairs(load_rows([path]), tokenizer)
    for sharing in (False, True):
        how = PairTokenization(prefix_sharing=sharing)
        data = select(path, tokenizer, tmp_path / "cache", how).finish(False)
        segments = [how.segments(pair, i) for i, pair in enumerate(pairs)]
        assert data.lengths.tolist() == [[len(s.tokens) for s in segs] for segs in segments]
        assert data.labels.tolist() == [[s.num_labels for s in segs] for segs in segments]


def test_max_samples_without_a_mixture_stops_early_and_caches_nothing(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prepared, "CHUNK_ROWS", 10)
    path = write(tmp_path / "train.jsonl", sft_rows(50))
    selection = select(path, tokenizer, tmp_path / "cache", max_samples=15)
    assert len(selection) == 15 and "20 rows tokenized" in selection.notice and "not cached" in selection.notice
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


@pytest.mark.parametrize("name, writer, where", [("prompts.jsonl", write, lambda path, i: f"{path}:{i + 1}"),
                                                 ("prompts.json", write_array, lambda path, i: f"{path}[{i}]")])
def test_a_prompt_set_reads_each_prompt_by_id(tmp_path, tokenizer, name, writer, where):
    """RL prompt sets take the same pass: the usable rows' ids only, each prompt read and tokenized when asked for
    (the ids ``tokenizer(prompt)`` gives), a row with no prompt or a prompt over --prompt_max_len left out and
    counted, a bad row named by file and line (by index in a ``.json`` array)."""
    from openpack.data.prompt_set import PromptSet, PromptTokenization
    from openpack.data.prompts import Prompt

    rows = [{"prompt": f"{i}+{i}=" * (1 + i % 4), "answer": str(2 * i)} for i in range(20)]
    rows[3] = {"question": "1+1="}  # no prompt
    path = writer(tmp_path / name, rows)
    expected = [Prompt(tokenizer(row["prompt"])["input_ids"], row["prompt"], row, where(path, i))
                for i, row in enumerate(rows) if "prompt" in row]
    long = [p for p in expected if len(p.tokens) > 12]
    expected = [p for p in expected if len(p.tokens) <= 12]
    how = PromptTokenization(prompt_max_len=12)
    selection = select(path, tokenizer, tmp_path / "cache", how, skip_bad_samples=True)
    data = selection.finish(True)
    prompts = PromptSet(selection.files, data.rows, tokenizer, how)
    assert len(long) > 0 and len(prompts) == len(expected) and list(prompts) == expected
    assert prompts[-1] == expected[-1] and prompts[2:4] == expected[2:4]
    assert data.summary == f"{len(expected)} used, {len(long)} longer than --prompt_max_len 12, 1 no prompt left out"
    with pytest.raises(DataError, match="no 'prompt' key") as err:
        select(path, tokenizer, tmp_path / "cache", how).finish(False)
    assert where(path, 3) in str(err.value)
