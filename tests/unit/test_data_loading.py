"""load_rows: every file kind, errors a user can act on, counted skips, and mixing.

Datasets are written to tmp_path; nothing touches the network (a hub name is
only tried in the test that checks the error wording, with loading stubbed).
"""

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openpack.data import loading
from openpack.data.loading import DataError, Rows, load_rows

ROWS = [{"prompt": "1+2=", "response": "3"}, {"prompt": "2+2=", "response": "4"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def numbered(n, tag):
    return [{"i": i, "tag": tag} for i in range(n)]


def test_jsonl_rows_and_line_sources(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")  # blank line 2 ignored
    rows = load_rows([str(path)])
    assert rows.rows == ROWS
    assert rows.sources == [f"{path}:1", f"{path}:3"]
    assert rows.skipped == Counter() and len(rows) == 2


def test_json_array_and_jsonl_content_in_json(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps(ROWS, indent=2))
    lines = write_jsonl(tmp_path / "b.json", ROWS)
    assert load_rows([str(array)]) == Rows(ROWS, [f"{array}[0]", f"{array}[1]"], Counter())
    assert load_rows([str(lines)]) == Rows(ROWS, [f"{lines}:1", f"{lines}:2"], Counter())
    single = tmp_path / "c.json"
    single.write_text(json.dumps(ROWS[0], indent=2))  # one pretty-printed object
    assert load_rows([str(single)]) == Rows([ROWS[0]], [f"{single}[0]"], Counter())


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows([str(path)]) == Rows(ROWS, [f"{path}[0]", f"{path}[1]"], Counter())


def test_folder_reads_data_files_sorted_and_not_recursive(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [ROWS[1]])
    (tmp_path / "a.json").write_text(json.dumps([ROWS[0]]))
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", [{"prompt": "deep", "response": "x"}])
    rows = load_rows([str(tmp_path)])
    assert rows.rows == ROWS
    assert rows.sources == [f"{tmp_path / 'a.json'}[0]", f"{tmp_path / 'b.jsonl'}:1"]


def test_missing_local_file_names_the_path_and_never_tries_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loading, "_read_hub", lambda *a: pytest.fail("a local-looking path went to the hub"))
    for spec in [str(tmp_path / "nope.jsonl"), "data/typo.jsonl", "./data", "a/b/c"]:
        with pytest.raises(DataError, match="file not found") as err:
            load_rows([spec])
        assert spec in str(err.value)


def test_hub_failure_says_it_was_treated_as_a_hub_name(monkeypatch):
    import datasets

    calls = []

    def offline(name, split):
        calls.append((name, split))
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as err:
        load_rows(["org/some-set@test"])
    assert calls == [("org/some-set", "test")]
    message = str(err.value)
    assert "org/some-set@test" in message and "hub" in message and "no local file" in message
    assert "network" in message


def test_hub_rows_get_index_sources(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: list(ROWS))
    rows = load_rows(["org/set:validation"])
    assert rows.rows == ROWS and rows.sources == ["org/set@validation[0]", "org/set@validation[1]"]


def test_malformed_json_line_is_reported_as_file_colon_line(tmp_path):
    path = tmp_path / "file.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + '\n{"prompt": "3+3=",\n')
    with pytest.raises(DataError, match="malformed JSON") as err:
        load_rows([str(path)])
    assert "file.jsonl:3" in str(err.value) and "--skip_bad_samples" in str(err.value)


def test_malformed_lines_and_non_objects_are_counted_when_skipping(tmp_path):
    path = tmp_path / "file.jsonl"
    lines = [json.dumps(ROWS[0]).encode(), b"{oops", b"[1, 2]", b"\xff", json.dumps(ROWS[1]).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")  # line 4 is not even UTF-8
    rows = load_rows([str(path)], skip_bad_samples=True)
    assert rows.rows == ROWS and rows.sources == [f"{path}:1", f"{path}:5"]
    assert rows.skipped == Counter({"malformed json": 2, "not a JSON object": 1})


def test_non_object_row_errors_without_skipping(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([ROWS[0], "just a string"]))
    with pytest.raises(DataError, match="not an object") as err:
        load_rows([str(path)])
    assert f"{path}[1]" in str(err.value)


def test_empty_file_is_an_error_naming_the_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    with pytest.raises(DataError, match="no rows left") as err:
        load_rows([str(good), str(empty)])
    assert str(empty) in str(err.value) and "no rows in the file" in str(err.value)


def test_dataset_empty_after_skipping_says_what_was_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n[1]\n")
    with pytest.raises(DataError) as err:
        load_rows([str(path)], skip_bad_samples=True)
    message = str(err.value)
    assert str(path) in message and "all 2 rows skipped" in message
    assert "malformed json: 1" in message and "not a JSON object: 1" in message


def test_concatenation_without_probs_keeps_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(3, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", numbered(2, "b"))
    rows = load_rows([str(a), str(b)])
    assert [(r["tag"], r["i"]) for r in rows.rows] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]


def test_mixture_is_deterministic_and_follows_probs(tmp_path):
    """1000 + 1000 rows at 0.75/0.25: 2000 rows, ~1500 from a (binomial sd ~19, so 4% is > 4 sd)."""
    a = write_jsonl(tmp_path / "a.jsonl", numbered(1000, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", numbered(1000, "b"))
    mix = load_rows([str(a), str(b)], probs=[0.75, 0.25], seed=3)
    assert mix == load_rows([str(a), str(b)], probs=[0.75, 0.25], seed=3)
    assert mix.sources != load_rows([str(a), str(b)], probs=[0.75, 0.25], seed=4).sources
    share = Counter(r["tag"] for r in mix.rows)
    assert len(mix) == 2000 and abs(share["a"] / 2000 - 0.75) < 0.04
    # The over-sampled source cycles: every row of a appears before any repeats.
    a_rows = [r["i"] for r in mix.rows if r["tag"] == "a"]
    assert sorted(a_rows[:1000]) == list(range(1000)) and len(set(a_rows)) == 1000
    # The under-sampled source is drawn without repeats.
    b_rows = [r["i"] for r in mix.rows if r["tag"] == "b"]
    assert len(set(b_rows)) == len(b_rows)


def test_single_dataset_with_prob_one_is_unchanged(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(5, "a"))
    assert load_rows([str(a)], probs=[1.0]) == load_rows([str(a)])


@pytest.mark.parametrize(
    "probs, match",
    [([1.0], "2 datasets"), ([0.5, 0.6], "sum to 1"), ([1.0, 0.0], "> 0"), ([1.5, -0.5], "> 0")],
)
def test_bad_probs_name_the_flag(tmp_path, probs, match):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", ROWS)
    with pytest.raises(DataError, match=match) as err:
        load_rows([str(a), str(b)], probs=probs)
    assert "--dataset_probs" in str(err.value)
