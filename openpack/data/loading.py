"""Rows for training from local files, folders or the Hugging Face hub, read by index, with mixing.

``--dataset`` names one or more datasets; each is a list of ``RowFile``s
whose rows are read by index and never all held: a JSONL file is a table of
where each line starts (8 bytes a line, found by one numpy scan), and a row
is one ``pread`` of its line; a parquet file is a memory-mapped Arrow table;
a hub dataset is ``datasets``' own memory-mapped Arrow cache. Every row is
tagged with where it came from (``data/train.jsonl:17``), so every later
error can say "fix line 17" instead of "sample 16383". A row has a *global
id*: its place in the datasets' files, concatenated in order (blank lines
included), the same in the driver and on every rank.

Trade-offs:

* A 60 MB JSONL of 200k rows costs 1.6 MB of line offsets (the old loader
  held every row as a dict: about 1 KB a row). ``load_rows`` still returns
  every row as Python dicts (``Rows``): for small sets (held-out data,
  ``openpack score``, tests). Training reads through ``prepared.py``, which
  keeps lengths only.
* A ``.json`` array is indexed like JSONL (``json_array.py``: each element's
  byte span and line, 24 bytes a row) and read by index, an element at a time;
  a broken element is one bad row, named ``file.json[16]`` with its line.
  Only a file that is one object (not an array) is parsed whole and held.
* JSONL is parsed line by line with ``json.loads`` rather than through
  ``datasets``, so a malformed line is reported as ``file.jsonl:3`` and can be
  skipped and counted with ``--skip_bad_samples``.
* A spec that looks like a local path (absolute, ``./``, ``~``, two or more
  ``/``, or a data suffix) is never sent to the hub: a typo gives "file not
  found", not a confusing network error. ``org/name`` (one ``/``) is a hub id
  when no such local folder exists.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from openpack.data.json_array import ArrayStructureError, index_json_array

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
SKIP_HINT = "or pass --skip_bad_samples to skip such rows and count them"


class DataError(ValueError):
    """A dataset problem a user can fix; the message names the file, row, key and flag.

    ``reason`` is a short key (``"malformed json"``) under which
    ``--skip_bad_samples`` counts the row instead of raising; None means the
    problem is not about one row and cannot be skipped.
    """

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


@dataclass
class Rows:
    """Loaded rows, ``sources[i]`` saying where ``rows[i]`` came from, and skip counts."""

    rows: list[dict]
    sources: list[str]
    skipped: Counter = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.rows)


def load_rows(
    datasets: list[str],
    probs: list[float] | None = None,
    seed: int = 0,
    skip_bad_samples: bool = False,
    split: str = "train",
    flag: str = "--dataset",
) -> Rows:
    """Load every row of every dataset in ``datasets``, concatenated or mixed, as Python dicts (small sets only:
    training plans from lengths, ``prepared.py``).

    Each spec is a ``.jsonl``/``.json``/``.parquet`` file, a folder (its
    files with those suffixes, sorted, not recursive), or a hub dataset
    ``name``, ``name@split`` or ``name:split`` (default ``split``).

    Without ``probs`` the datasets are concatenated in order. With ``probs``
    (one per dataset, > 0, summing to 1) and two or more datasets, the result
    is a deterministic mixture for ``seed`` with as many rows as the datasets
    together (``choose_rows``).

    Raises DataError for a missing file, a bad row (unless
    ``skip_bad_samples``), bad ``probs``, or a dataset with no rows;
    messages name ``flag``, the command's flag (``--prompt_data`` for RL).
    """
    files = open_datasets(datasets, split, flag)
    if probs is not None:
        check_probs(datasets, probs, flag)
    values, parts, skipped_per = {}, [], []
    for spec_files in files.per_spec:
        good, skipped = [], Counter()
        for file, first in spec_files:
            for local, value in enumerate(file.read(np.arange(file.size))):
                if value is None:
                    continue
                if isinstance(value, DataError):
                    skip_or_raise(value, skip_bad_samples, skipped)
                    continue
                values[first + local] = value
                good.append(first + local)
        parts.append(np.array(good, dtype=np.int64))
        skipped_per.append(skipped)
    check_not_empty(datasets, [len(p) for p in parts], skipped_per, flag)
    ids = choose_rows(parts, probs, seed)
    return Rows([values[i] for i in ids.tolist()], [files.source(i) for i in ids.tolist()], sum(skipped_per, Counter()))


@dataclass
class RowFile:
    """One data file (or hub split) whose rows are read by index: ``read(local indices)`` gives each row's value,
    a ``DataError`` for a row that is not a JSON object, or None for a blank line.

    ``kind``: ``jsonl`` (``lines[k]`` is where line k starts; the last entry is one past the end), ``array`` (a
    ``.json`` array: ``spans[k]`` is element k's byte range, ``lines[k]`` the line it starts on), ``held`` (rows
    parsed and held: a ``.json`` file of one object, or a window of a table), ``table`` (a parquet file's
    memory-mapped Arrow table, or a hub dataset).
    ``digest`` names the content (sha256 of a file; a hub dataset's fingerprint).
    """

    name: str
    kind: str
    size: int
    digest: str
    lines: np.ndarray | None = None
    spans: np.ndarray | None = None
    held: list | None = None
    table: object = None
    offset: int = 0  # a window's first row in its file

    def source(self, local: int) -> str:
        at = local + self.offset
        return f"{self.name}:{at + 1}" if self.kind == "jsonl" else f"{self.name}[{at}]"

    def read(self, local: np.ndarray) -> list:
        """The rows at ``local`` (ascending or not), each a dict, a DataError, or None (a blank line)."""
        local = np.asarray(local, dtype=np.int64)
        if self.kind == "jsonl":
            return [_parse_line(line, self.source(i), i + self.offset == 0)
                    for i, line in zip(local.tolist(), self._bytes(local))]
        if self.kind == "array":
            return [_parse_element(text, self.source(i), int(self.lines[i]))
                    for i, text in zip(local.tolist(), self._bytes(local))]
        return [_check_object(value, self.source(i)) for i, value in zip(local.tolist(), self._values(local))]

    def window(self, start: int, stop: int) -> RowFile:
        """Rows ``start:stop`` as a RowFile of their own, small to send to another process: a JSONL window reads
        its lines there; other kinds carry their values."""
        if self.kind == "jsonl":
            return RowFile(self.name, "jsonl", stop - start, self.digest, lines=self.lines[start:stop + 1],
                           offset=start)
        if self.kind == "array":
            return RowFile(self.name, "array", stop - start, self.digest, lines=self.lines[start:stop],
                           spans=self.spans[start:stop], offset=start)
        return RowFile(self.name, "held", stop - start, self.digest, held=self._values(np.arange(start, stop)),
                       offset=start)

    def _values(self, local: np.ndarray) -> list:
        if self.kind == "held":
            return [self.held[i] for i in local.tolist()]
        if hasattr(self.table, "take"):  # pyarrow
            return self.table.take(local).to_pylist()
        if hasattr(self.table, "select"):  # a datasets.Dataset
            return self.table.select(local).to_list()
        return [self.table[i] for i in local.tolist()]  # a plain sequence

    def _bytes(self, local: np.ndarray) -> list[bytes]:
        """The bytes of each row at ``local`` (a JSONL line, an array element): one read for a run of consecutive
        rows, else one read each."""
        if self.kind == "jsonl":
            starts, stops = self.lines[local], self.lines[local + 1] - 1
        else:
            starts, stops = self.spans[local, 0], self.spans[local, 1]
        with open(self.name, "rb") as f:
            fd = f.fileno()
            if len(local) and local[-1] - local[0] == len(local) - 1 and np.all(np.diff(local) == 1):
                base = int(starts[0])
                data = os.pread(fd, max(0, int(stops[-1]) - base), base)
                return [data[a - base:b - base] for a, b in zip(starts.tolist(), stops.tolist())]
            return [os.pread(fd, max(0, b - a), a) for a, b in zip(starts.tolist(), stops.tolist())]


@dataclass
class DatasetFiles:
    """The files of every dataset spec, in order; a row's global id is its file's ``first`` plus its index there."""

    per_spec: list[list[tuple[RowFile, int]]]  # per spec: (file, first global id)

    @property
    def files(self) -> list[RowFile]:
        return [file for spec in self.per_spec for file, _ in spec]

    def _starts(self) -> np.ndarray:
        return np.array([first for spec in self.per_spec for _, first in spec], dtype=np.int64)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file number, index in that file) of each global id."""
        starts = self._starts()
        which = np.searchsorted(starts, ids, side="right") - 1
        return which, ids - starts[which]

    def source(self, row: int) -> str:
        which, local = self.locate(np.array([row]))
        return self.files[int(which[0])].source(int(local[0]))

    def read(self, ids: np.ndarray) -> Rows:
        """The rows with these global ids, in that order, as Python dicts (every one must be a good row)."""
        ids = np.asarray(ids, dtype=np.int64)
        which, local = self.locate(ids)
        values: list = [None] * len(ids)
        files = self.files
        for f in np.unique(which).tolist():
            at = np.flatnonzero(which == f)
            order = np.argsort(local[at], kind="stable")
            for position, value in zip(at[order].tolist(), files[f].read(local[at][order])):
                values[position] = value
        bad = next((v for v in values if not isinstance(v, dict)), False)
        if bad is not False:
            raise DataError(f"a row planned for training is no longer a JSON object ({bad}); did the file change "
                            "during the run?")
        return Rows(values, [files[f].source(i) for f, i in zip(which.tolist(), local.tolist())])


def open_datasets(datasets: list[str], split: str = "train", flag: str = "--dataset") -> DatasetFiles:
    """Every file of every dataset, indexed (no row parsed yet: JSONL lines are found, parquet mapped)."""
    if not datasets:
        raise DataError(f"no dataset given: pass {flag} PATH_OR_HUB_NAME (several: {flag} a.jsonl b.jsonl)")
    per_spec, first = [], 0
    for spec in datasets:
        files = []
        for file in _open_dataset(spec, split, flag):
            files.append((file, first))
            first += file.size
        per_spec.append(files)
    return DatasetFiles(per_spec)


def choose_rows(parts: list[np.ndarray], probs: list[float] | None, seed: int) -> np.ndarray:
    """The global ids of the rows to use, from each dataset's good rows ``parts[i]``: concatenated without
    ``probs``; with ``probs`` and two or more datasets a mixture of as many rows as the datasets together, each
    row's dataset drawn with probability ``probs[i]``, a dataset yielding its rows in a seeded shuffled order,
    reshuffled after each pass, so an over-sampled dataset repeats rows and an under-sampled one leaves some out.
    E.g. 1000 + 1000 rows with probs 0.75/0.25 gives ~1500 rows from the first (every row once, ~500 twice) and
    ~500 from the second."""
    if probs is None or len(parts) < 2:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    rng = random.Random(f"mix:{seed}")  # str seeds hash with sha512: stable across processes
    picks = rng.choices(range(len(parts)), weights=probs, k=sum(len(p) for p in parts))
    streams = [_shuffled_cycle(len(part), random.Random(f"mix:{seed}:{i}")) for i, part in enumerate(parts)]
    positions = np.array([next(streams[i]) for i in picks], dtype=np.int64)
    which = np.array(picks, dtype=np.int64)
    out = np.empty(len(picks), dtype=np.int64)
    for i, part in enumerate(parts):
        at = which == i
        out[at] = part[positions[at]]
    return out


def check_dataset_files(datasets: list[str], flag: str = "--dataset") -> None:
    """Before anything starts: every dataset of ``flag`` (--dataset, --prompt_data) naming a local file or folder
    exists and can be read.

    Only the first byte of each file is read, so a bad path or permission is reported in a second,
    not after a cluster and a model have started. Hub datasets are checked when they load.
    """
    for spec in datasets:
        path = os.path.expanduser(spec)
        if not os.path.exists(path):
            if _looks_local(spec):
                raise DataError(f"{flag} {spec}: file not found ({os.path.abspath(path)}); check the path")
            continue
        for file in _data_files(spec, path, flag):
            try:
                with open(file, "rb") as f:
                    f.read(1)
            except OSError as err:
                raise DataError(f"{flag} {spec}: cannot read {file} ({err.strerror}); check the file's "
                                "permissions, or pass a file this user can read") from err


def check_probs(datasets: list[str], probs: list[float], flag: str) -> None:
    """--dataset_probs (``flag``_probs): one finite positive weight per dataset, summing to 1 within 1e-6."""
    shown = ", ".join(str(p) for p in probs)
    if len(probs) != len(datasets):
        raise DataError(
            f"{flag}_probs has {len(probs)} values ({shown}) but {flag} has {len(datasets)} datasets; "
            "give one probability per dataset, in the same order"
        )
    if not all(isinstance(p, (int, float)) and math.isfinite(p) and p > 0 for p in probs):
        raise DataError(
            f"{flag}_probs must all be > 0, got {shown}; drop a dataset from {flag} instead of giving it 0"
        )
    if abs(sum(probs) - 1.0) > 1e-6:
        raise DataError(f"{flag}_probs must sum to 1, got {shown} (sum {sum(probs):.6g}); rescale them")


def check_not_empty(datasets: list[str], sizes: list[int], skipped_per: list[Counter], flag: str) -> None:
    """Every dataset must give at least one row; a mixture cannot draw from an empty one."""
    empty = [(spec, skipped) for spec, size, skipped in zip(datasets, sizes, skipped_per) if not size]
    if not empty:
        return
    described = "; ".join(f"{spec} ({_describe_skips(skipped)})" for spec, skipped in empty)
    raise DataError(
        f"no rows left in {len(empty)} of {len(datasets)} datasets: {described}. "
        f"Check the {flag} paths, fix the rows, or remove the dataset from {flag}"
    )


def _describe_skips(skipped: Counter) -> str:
    if not skipped:
        return "no rows in the file(s)"
    counts = ", ".join(f"{reason}: {n}" for reason, n in skipped.most_common())
    return f"all {sum(skipped.values())} rows skipped by --skip_bad_samples; {counts}"


def _shuffled_cycle(size: int, rng: random.Random) -> Iterator[int]:
    """Yield ``range(size)`` in a shuffled order, forever, reshuffling after each pass."""
    while True:
        order = list(range(size))
        rng.shuffle(order)
        yield from order


def _open_dataset(spec: str, split: str, flag: str) -> list[RowFile]:
    """The files of one --dataset spec: a local file or folder, else a hub dataset."""
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return [_open_file(file) for file in _data_files(spec, path, flag)]
    if _looks_local(spec):
        raise DataError(f"{flag} {spec}: file not found ({os.path.abspath(path)}); check the path")
    return [_read_hub(spec, split, flag)]


def _looks_local(spec: str) -> bool:
    """True for specs that can only mean a local path; hub ids are ``name`` or ``org/name``."""
    if spec.lower().endswith(DATA_SUFFIXES) or os.path.isabs(spec) or spec.startswith((".", "~")):
        return True
    return spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def _data_files(spec: str, path: str, flag: str) -> list[str]:
    """The file itself, or a folder's data files (sorted, not recursive)."""
    if not os.path.isdir(path):
        if not path.lower().endswith(DATA_SUFFIXES):
            raise DataError(f"{flag} {spec}: unsupported file type; use {', '.join(DATA_SUFFIXES)}")
        return [path]
    names = sorted(n for n in os.listdir(path) if n.lower().endswith(DATA_SUFFIXES))
    files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
    if not files:
        raise DataError(f"{flag} {spec}: folder has no {'/'.join(DATA_SUFFIXES)} files; check the path")
    return files


def _open_file(path: str) -> RowFile:
    """One local file as a RowFile, by its suffix."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        return _open_parquet(path)
    if lower.endswith(".json"):
        held = _read_json(path)
        if held is not None:
            return held
    digest, lines = scan_lines(path)
    return RowFile(path, "jsonl", len(lines) - 1, digest, lines=lines)


SCAN_BLOCK = 1 << 24  # 16 MiB read at a time: the scan's memory is this plus 8 bytes a line


def scan_lines(path: str) -> tuple[str, np.ndarray]:
    """(sha256 of the file, where each line starts plus one past the end): one read of the file, in blocks.

    Line k is ``data[lines[k]:lines[k + 1] - 1]``; as with ``split(b"\\n")``, a file ending in a newline has an
    empty last line. 200k lines of 60 MB scan in about 0.2 s.
    """
    digest, starts, offset = hashlib.sha256(), [np.zeros(1, dtype=np.int64)], 0
    with open(path, "rb") as f:
        while block := f.read(SCAN_BLOCK):
            digest.update(block)
            starts.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64) + offset + 1)
            offset += len(block)
    starts.append(np.array([offset + 1], dtype=np.int64))
    return digest.hexdigest(), np.concatenate(starts)


def _parse_line(line: bytes, where: str, first: bool) -> object:
    """A JSONL line's row: a dict, a DataError (malformed, or not an object), or None for a blank line."""
    if first:
        line = line.removeprefix(codecs.BOM_UTF8)
    if not line.strip():
        return None
    try:
        value = json.loads(line)
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError on bad bytes
        detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
        return DataError(f"{where}: malformed JSON ({detail}); fix the line, {SKIP_HINT}", "malformed json")
    return _check_object(value, where)


def _read_json(path: str) -> RowFile | None:
    """A ``.json`` file: an array of objects, indexed (sources ``path[i]``); a single object, held; None for JSONL
    content (a first line that parses alone, or an array followed by more lines)."""
    with open(path, "rb") as f:
        start = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()
        while not start and (more := f.read(1 << 16)):
            start = more.lstrip()
        if not start.startswith(b"["):
            f.seek(0)
            head = next((line for line in f if line.strip()), b"").removeprefix(codecs.BOM_UTF8)
    if start.startswith(b"["):
        try:
            index = index_json_array(path)
        except ArrayStructureError as err:
            raise DataError(
                f"{path}:{err.line}: malformed JSON array ({err}); with no element boundaries to go by, "
                "--skip_bad_samples cannot help: fix the file or convert it to JSONL (one object per line)"
            ) from err
        if index is None:
            return None
        return RowFile(path, "array", len(index.spans), index.digest, lines=index.lines, spans=index.spans)
    try:
        json.loads(head)
        return None  # a whole object on its first line: JSONL
    except ValueError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    try:
        whole = json.loads(data.removeprefix(codecs.BOM_UTF8))  # one (possibly pretty-printed) object
    except ValueError:
        return None  # JSONL with a broken first line: reported by line
    return RowFile(path, "held", 1, hashlib.sha256(data).hexdigest(), held=[whole])


def _parse_element(text: bytes, where: str, line: int) -> object:
    """An array element's row: a dict, or a DataError naming the element and the line of the problem."""
    try:
        value = json.loads(text)
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError on bad bytes
        if isinstance(err, json.JSONDecodeError):
            where, detail = f"{where} (line {line + err.lineno - 1})", err.msg
        else:
            where, detail = f"{where} (line {line})", str(err)
        return DataError(f"{where}: malformed JSON ({detail}); fix the element, {SKIP_HINT}", "malformed json")
    return _check_object(value, where)


def _open_parquet(path: str) -> RowFile:
    """A parquet file as a memory-mapped Arrow table; sources ``path[i]`` (0-based row index)."""
    import pyarrow.parquet as pq  # lazy: only parquet users pay for the import

    digest = scan_lines(path)[0]
    try:
        table = pq.read_table(path, memory_map=True)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet ({err}); check the file is a valid parquet file") from err
    return RowFile(path, "table", table.num_rows, digest, table=table)


def _read_hub(spec: str, split: str, flag: str) -> RowFile:
    """A Hugging Face hub dataset, ``name``, ``name@split`` or ``name:split``."""
    name, split = _hub_name_and_split(spec, split)
    try:
        import datasets

        table = datasets.load_dataset(name, split=split)
    except Exception as err:  # network, auth, missing split: all end the same way for the user
        raise DataError(
            f"{flag} {spec}: no local file or folder of that name exists, so it was treated as a Hugging "
            f"Face hub dataset ({name!r}, split {split!r}) and loading failed: {type(err).__name__}: {err}. "
            "Check the local path, or the hub name and split; this machine may have no network access"
        ) from err
    digest = getattr(table, "_fingerprint", None) or hashlib.sha256(repr(list(table)).encode()).hexdigest()
    return RowFile(f"{name}@{split}", "table", len(table), f"{name}@{split}:{digest}", table=table)


def _hub_name_and_split(spec: str, split: str) -> tuple[str, str]:
    for sep in ("@", ":"):
        if sep in spec:
            name, _, suffix = spec.rpartition(sep)
            return name, suffix or split
    return spec, split


def _check_object(row: object, where: str) -> object:
    """The row if it is a JSON object, else the DataError saying what it is."""
    if isinstance(row, dict):
        return row
    return DataError(
        f"{where}: row is a JSON {type(row).__name__}, not an object like "
        f'{{"prompt": "...", "response": "..."}}; fix the row, {SKIP_HINT}',
        "not a JSON object",
    )


def skip_or_raise(err: DataError, skip: bool, skipped: Counter) -> None:
    """Count a skippable error under its reason when skipping; raise it otherwise."""
    if not skip or err.reason is None:
        raise err
    skipped[err.reason] += 1
