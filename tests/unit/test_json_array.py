"""A ``.json`` array read by index (issue 45, item 1): each element's span equals what ``json.loads`` of the whole
file gives, whatever the strings hold (brackets, commas, escaped quotes, backslash runs) and wherever the scan's
blocks split the file; a broken element is one bad row named by index and line; a file that never balances fails
whole, naming the line where its array opened."""

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openpack.data import json_array
from openpack.data.loading import DataError, Rows, load_rows

TRICKY = st.sampled_from(['"', "\\", "\\\\", '\\"', "[", "]", "{", "}", ",", "\n", "é", "\u2028", "a", " "])
TEXT = st.lists(TRICKY, max_size=8).map("".join)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                      max_leaves=8)
ROWS = st.lists(st.dictionaries(TEXT, VALUES, max_size=4), max_size=6)


@settings(max_examples=300, deadline=None)
@given(rows=ROWS, indent=st.sampled_from([None, 0, 2]), block=st.integers(1, 64), bom=st.booleans())
def test_elements_equal_json_loads_of_the_whole_file(tmp_path_factory, rows, indent, block, bom):
    path = tmp_path_factory.mktemp("array") / "rows.json"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + b"\n " + json.dumps(rows, indent=indent).encode() + b"\n")
    saved, json_array.BLOCK = json_array.BLOCK, block  # blocks of 1..64 bytes: every split point gets crossed
    try:
        index = json_array.index_json_array(str(path))
    finally:
        json_array.BLOCK = saved
    data = path.read_bytes()
    assert [json.loads(data[a:b]) for a, b in index.spans.tolist()] == rows
    assert [data[:a].count(b"\n") + 1 for a, _ in index.spans.tolist()] == index.lines.tolist()
    if rows:
        assert load_rows([str(path)]).rows == rows


def test_a_broken_element_is_one_bad_row_named_by_index_and_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"prompt": "a", "response": "b"},\n  {"prompt": "c",\n   "response": },\n'
                    '  {"prompt": "e", "response": "f"}\n]\n')
    with pytest.raises(DataError, match="malformed JSON") as err:
        load_rows([str(path)])
    assert f"{path}[1] (line 4)" in str(err.value) and "--skip_bad_samples" in str(err.value)
    rows = load_rows([str(path)], skip_bad_samples=True)
    assert rows == Rows([{"prompt": "a", "response": "b"}, {"prompt": "e", "response": "f"}],
                        [f"{path}[0]", f"{path}[2]"], Counter({"malformed json": 1}))


@pytest.mark.parametrize("block", [1, 1 << 22])  # the [ in a later block than the file's first, or in the first
@pytest.mark.parametrize("text", ['\n[\n{"a": 1},\n{"a": "never closed}\n]\n',  # a string runs to the end
                                  '\n[\n{"a": 1},\n{"a": [1, 2}\n'])  # cut short
def test_an_array_that_never_closes_fails_whole_naming_where_it_opened(tmp_path, monkeypatch, text, block):
    monkeypatch.setattr(json_array, "BLOCK", block)
    path = tmp_path / "train.json"
    path.write_text(text)
    with pytest.raises(DataError) as err:
        load_rows([str(path)], skip_bad_samples=True)
    assert f"{path}:2: malformed JSON array" in str(err.value) and "convert it to JSONL" in str(err.value)


def test_jsonl_whose_rows_are_arrays_is_read_by_line(tmp_path):
    """Content after the first array means one value a line: each row is then named by its line (not an object)."""
    path = tmp_path / "rows.json"
    path.write_text('[1, 2]\n{"prompt": "a", "response": "b"}\n')
    rows = load_rows([str(path)], skip_bad_samples=True)
    assert rows == Rows([{"prompt": "a", "response": "b"}], [f"{path}:2"], Counter({"not a JSON object": 1}))


def test_an_empty_array_has_no_rows(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[ \n ]")
    assert len(json_array.index_json_array(str(path)).spans) == 0
    with pytest.raises(DataError, match="no rows"):
        load_rows([str(path)])
