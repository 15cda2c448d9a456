"""Rows for training from local files, folders or the Hugging Face hub, with mixing.

``--dataset`` names one or more datasets; each becomes a list of JSON-object
rows, each row tagged with where it came from (``data/train.jsonl:17``), so
every later error can say "fix line 17" instead of "sample 16383".

Trade-offs:

* Everything is read into memory as Python dicts. That keeps the code short
  and lets the driver plan packs over the whole epoch (DESIGN.md: the planner
  sees every length). Measured on 2 CPU cores: 100k rows of 500 characters
  (53 MB of JSONL) take 1 s and ~100 MB of RAM, with a ~210 MB peak while
  reading; tens of millions of rows would need a streaming reader.
* JSONL is read line by line with ``json.loads`` rather than through
  ``datasets``, so a malformed line is reported as ``file.jsonl:3`` and can be
  skipped and counted with ``--skip_bad_samples``; a JSON array is parsed as a
  whole, so one broken bracket fails the whole file.
* A spec that looks like a local path (absolute, ``./``, ``~``, two or more
  ``/``, or a data suffix) is never sent to the hub: a typo gives "file not
  found", not a confusing network error. ``org/name`` (one ``/``) is a hub id
  when no such local folder exists.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
SKIP_HINT = "or pass --skip_bad_samples to skip such rows and count them"
Pairs = list[tuple[dict, str]]  # (row, source) in file order



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
    """Load every dataset in ``datasets`` and concatenate or mix them.

    Each spec is a ``.jsonl``/``.json``/``.parquet`` file, a folder (its
    files with those suffixes, sorted, not recursive), or a hub dataset
    ``name``, ``name@split`` or ``name:split`` (default ``split``).

    Without ``probs`` the datasets are concatenated in order. With ``probs``
    (one per dataset, > 0, summing to 1) and two or more datasets, the result
    is a deterministic mixture for ``seed`` with as many rows as the datasets
    together: each row's source is drawn with probability ``probs[i]``, and a
    source yields its rows in a seeded shuffled order, reshuffled after each
    pass, so an over-sampled source repeats rows and an under-sampled one
    leaves some out. E.g. 1000 + 1000 rows with probs 0.75/0.25 gives ~1500
    rows from the first (every row once, ~500 twice) and ~500 from the second.
    One dataset with ``probs=[1.0]`` is returned in file order.

    Raises DataError for a missing file, a bad row (unless
    ``skip_bad_samples``), bad ``probs``, or a dataset with no rows;
    messages name ``flag``, the command's flag (``--prompt_data`` for RL).
    """
    if not datasets:
        raise DataError(f"no dataset given: pass {flag} PATH_OR_HUB_NAME (several: {flag} a.jsonl b.jsonl)")
    if probs is not None:
        _check_probs(datasets, probs, flag)
    parts, skipped_per = [], []
    for spec in datasets:
        skipped = Counter()
        parts.append(_load_dataset(spec, split, skip_bad_samples, skipped, flag))
        skipped_per.append(skipped)
    _check_not_empty(datasets, parts, skipped_per, flag)
    total_skipped = sum(skipped_per, Counter())
    pairs = _mix(parts, probs, seed) if probs is not None and len(parts) > 1 else [p for part in parts for p in part]
    return Rows([row for row, _ in pairs], [src for _, src in pairs], total_skipped)


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


def _check_probs(datasets: list[str], probs: list[float], flag: str) -> None:
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


def _check_not_empty(datasets: list[str], parts: list[Pairs], skipped_per: list[Counter], flag: str) -> None:
    """Every dataset must give at least one row; a mixture cannot draw from an empty one."""
    empty = [(spec, skipped) for spec, part, skipped in zip(datasets, parts, skipped_per) if not part]
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


def _mix(parts: list[Pairs], probs: list[float], seed: int) -> Pairs:
    """Draw len(all rows) rows; see ``load_rows`` for the semantics."""
    rng = random.Random(f"mix:{seed}")  # str seeds hash with sha512: stable across processes
    picks = rng.choices(range(len(parts)), weights=probs, k=sum(len(p) for p in parts))
    streams = [_shuffled_cycle(part, random.Random(f"mix:{seed}:{i}")) for i, part in enumerate(parts)]
    return [next(streams[i]) for i in picks]


def _shuffled_cycle(part: Pairs, rng: random.Random) -> Iterator[tuple[dict, str]]:
    """Yield ``part`` in a shuffled order, forever, reshuffling after each pass."""
    while True:
        order = list(range(len(part)))
        rng.shuffle(order)
        yield from (part[i] for i in order)


def _load_dataset(spec: str, split: str, skip: bool, skipped: Counter, flag: str) -> Pairs:
    """Rows of one --dataset spec: a local file or folder, else a hub dataset."""
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return [pair for file in _data_files(spec, path, flag) for pair in _read_file(file, skip, skipped)]
    if _looks_local(spec):
        raise DataError(f"{flag} {spec}: file not found ({os.path.abspath(path)}); check the path")
    return _read_hub(spec, split, skip, skipped, flag)


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


def _read_file(path: str, skip: bool, skipped: Counter) -> Pairs:
    """Rows of one local file, dispatched on its suffix."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        return _read_parquet(path, skip, skipped)
    with open(path, "rb") as f:
        data = f.read()
    if lower.endswith(".json"):
        return _read_json(path, data, skip, skipped)
    return _read_jsonl(path, data, skip, skipped)


def _read_jsonl(path: str, data: bytes, skip: bool, skipped: Counter) -> Pairs:
    """One JSON object per line; blank lines ignored; sources are ``path:line`` (1-based)."""
    pairs = []
    for lineno, line in enumerate(data.removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = _parse_line(line, where)
        except DataError as err:
            skip_or_raise(err, skip, skipped)
            continue
        if _accept_row(row, where, skip, skipped):
            pairs.append((row, where))
    return pairs


def _parse_line(line: bytes, where: str) -> object:
    try:
        return json.loads(line)
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError on bad bytes
        detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
        raise DataError(f"{where}: malformed JSON ({detail}); fix the line, {SKIP_HINT}", "malformed json") from err


def _read_json(path: str, data: bytes, skip: bool, skipped: Counter) -> Pairs:
    """A JSON array of objects (sources ``path[i]``), a single object, or JSONL content."""
    text = data.removeprefix(codecs.BOM_UTF8)
    if not text.lstrip().startswith(b"["):
        try:
            whole = json.loads(text)  # one (possibly pretty-printed) object
        except ValueError:
            return _read_jsonl(path, data, skip, skipped)  # JSONL in a .json file
        return [(whole, f"{path}[0]")] if _accept_row(whole, f"{path}[0]", skip, skipped) else []
    try:
        array = json.loads(text)
    except ValueError as err:
        where = f"{path}:{err.lineno}" if isinstance(err, json.JSONDecodeError) else path
        raise DataError(
            f"{where}: malformed JSON array ({err}); one broken array fails the whole file, so "
            "--skip_bad_samples cannot help: fix the file or convert it to JSONL (one object per line)"
        ) from err
    return _accept_all(array, path, skip, skipped)


def _read_parquet(path: str, skip: bool, skipped: Counter) -> Pairs:
    """Rows of a parquet file via pyarrow; sources ``path[i]`` (0-based row index)."""
    import pyarrow.parquet as pq  # lazy: only parquet users pay for the import

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet ({err}); check the file is a valid parquet file") from err
    return _accept_all(table.to_pylist(), path, skip, skipped)


def _read_hub(spec: str, split: str, skip: bool, skipped: Counter, flag: str) -> Pairs:
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
    return _accept_all(list(table), f"{name}@{split}", skip, skipped)


def _hub_name_and_split(spec: str, split: str) -> tuple[str, str]:
    for sep in ("@", ":"):
        if sep in spec:
            name, _, suffix = spec.rpartition(sep)
            return name, suffix or split
    return spec, split


def _accept_all(rows: list, origin: str, skip: bool, skipped: Counter) -> Pairs:
    """Rows of an indexed container; sources ``origin[i]`` (0-based)."""
    pairs = []
    for i, row in enumerate(rows):
        where = f"{origin}[{i}]"
        if _accept_row(row, where, skip, skipped):
            pairs.append((row, where))
    return pairs


def _accept_row(row: object, where: str, skip: bool, skipped: Counter) -> bool:
    """True for a JSON object; otherwise raise, or count it when skipping."""
    if isinstance(row, dict):
        return True
    err = DataError(
        f"{where}: row is a JSON {type(row).__name__}, not an object like "
        f'{{"prompt": "...", "response": "..."}}; fix the row, {SKIP_HINT}',
        "not a JSON object",
    )
    skip_or_raise(err, skip, skipped)
    return False


def skip_or_raise(err: DataError, skip: bool, skipped: Counter) -> None:
    """Count a skippable error under its reason when skipping; raise it otherwise."""
    if not skip or err.reason is None:
        raise err
    skipped[err.reason] += 1
