"""The driver's view of a dataset: a few numbers per row, from one parallel tokenizing pass cached on disk.

The planner needs each sample's segment lengths and label counts, nothing of
its text (DESIGN.md, Orchestration). ``select`` reads every data file once,
in chunks of ``CHUNK_ROWS`` rows on a pool of processes (the machine's cores,
``--dataset_num_proc``), each chunk tokenized in one batched call by the same
code the ranks train with (``SFTTokenization``/``PairTokenization``), and
keeps per row one record::

    status  flags  kind  reason  lengths[S]  labels[S]     (S segments: SFT 1, a pair 2, prefix-shared 3)
    u1      u1     u2    u2      int32 x S   int32 x S     -> 14 bytes a row for SFT, 22 for a pair

``status`` says whether the row is a sample, a blank line, a bad row (with
its reason, so ``--skip_bad_samples`` counts it) or a dropped one; a bad
row's message is not stored but made again, by tokenizing that one row, when
it must be shown (it names the file and line, as before). The records of a
file are saved in ``--data_cache_dir`` under a key made of the file's sha256,
the tokenizer (its whole serialized vocabulary, merges, normaliser and chat
template), the tokenization flags and this package's data code; the next run
(a resume, another seed, other ``--dataset_probs`` or ``--max_samples``)
memory-maps them and tokenizes nothing, and a changed file has another key.

Rows themselves stay in their files (``loading.py``); a rank reads its own
rows by global id and tokenizes them again (milliseconds for a step's
rows), so nothing but the ids crosses from the driver to the ranks.

Trade-offs: the whole file is tokenized on a first run even when
``--max_samples`` or a mixture uses part of it (so every later selection
is a cache hit), except that a run without ``--dataset_probs`` stops at the
first ``--max_samples`` rows, or at the first bad row it must report, and
then caches nothing. Token ids are not cached: 1M rows of ~100 tokens would
be ~500 MB on disk, and a rank's share of one step retokenizes in
milliseconds. Measured on 2 busy cores (``benchmarks/data_scale.py``,
docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pickle
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openpack.data.loading import (DataError, DatasetFiles, RowFile, Rows, check_not_empty, check_probs, choose_rows,
                                   open_datasets)

CACHE_VERSION = 1
CHUNK_ROWS = 4096  # rows per batched tokenizer call and per task of the pool
PARALLEL_FROM = 3 * CHUNK_ROWS  # rows: fewer are tokenized in this process (starting the pool costs seconds)
KEPT, BLANK, LOAD_BAD, BAD, DROPPED, FATAL, UNREAD = range(7)  # a record's status
TRUNCATED, PROMPT_TAIL = 1, 2  # a record's flags
_DATA_CODE = ("loading.py", "formats.py", "sft.py", "preference.py", "prompts.py", "prompt_set.py", "prepared.py")


def cache_root() -> Path:
    """Where openpack caches what it builds (demo models, tokenized lengths): ``$OPENPACK_CACHE``, else
    ``~/.cache/openpack``."""
    return Path(os.environ.get("OPENPACK_CACHE") or Path.home() / ".cache" / "openpack")


def default_cache_dir() -> Path:
    return cache_root() / "data"


@dataclass
class Prepared:
    """What the driver plans from: for each sample (a kept row, in the order the run uses them) its global row
    id, segment lengths and label counts, as arrays of numbers only."""

    rows: np.ndarray  # int64 [samples]: the row each sample is, a global id (``loading.DatasetFiles``)
    lengths: np.ndarray  # int32 [samples, segments]
    labels: np.ndarray  # int32 [samples, segments]
    summary: str  # the driver's "N samples from M rows (...); ..." line
    prompt_tails: int  # samples whose prompt's tail was left out (a BPE merge at the boundary)
    fingerprint: str  # names the tokenized samples (keys the reference log-prob cache)


@dataclass
class Selection:
    """The rows a run uses (loaded, mixed, cut to --max_samples), each with its tokenizing record; not yet
    filtered for bad or dropped rows, so a caller can split it first (``take``) and then ``finish`` it."""

    files: DatasetFiles
    rows: np.ndarray  # int64: global ids
    records: np.ndarray  # one record per selected row
    strings: list[str]  # kind and reason codes (1-based) -> text
    load_skipped: Counter  # rows --skip_bad_samples left out while loading (malformed JSON, not an object)
    keys: list[str]  # the cache key of each file
    notice: str  # one line: what was tokenized, what came from the cache
    tokenizer: object = dataclasses.field(repr=False, default=None)
    tokenization: object = None

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, positions: np.ndarray) -> Selection:
        """The selection of these positions (a mask or indices), in that order."""
        return dataclasses.replace(self, rows=self.rows[positions], records=self.records[positions])

    def read(self) -> Rows:
        """Every selected row as Python dicts (small selections: held-out rows)."""
        return self.files.read(self.rows)

    def finish(self, skip_bad_samples: bool) -> Prepared:
        """The samples: bad rows raise (their file and line) or are counted, dropped rows counted, kept ones'
        lengths kept. Raises DataError when nothing is left."""
        status = self.records["status"]
        must_raise = (status == FATAL) | ((status == BAD) & (not skip_bad_samples))
        if must_raise.any():
            raise self._error(int(np.argmax(must_raise)))
        report = self.tokenization.report(len(self))
        report.formats.update(self._counts(self.records["kind"]))
        report.drop_reasons.update(self._counts(self.records["reason"][status == DROPPED]))
        report.dropped = int((status == DROPPED).sum())
        report.skipped.update(self._counts(self.records["reason"][status == BAD]))
        kept = status == KEPT
        report.truncated = int((kept & (self.records["flags"] & TRUNCATED > 0)).sum())
        if not kept.any():
            raise self.tokenization.nothing_left(len(self), report)
        rows = self.rows[kept]
        digest = hashlib.sha256(json.dumps(self.keys).encode())
        digest.update(rows.tobytes())
        return Prepared(rows, np.ascontiguousarray(self.records["lengths"][kept]),
                        np.ascontiguousarray(self.records["labels"][kept]),
                        report.summary(int(kept.sum()), self.tokenization.max_len, self.load_skipped),
                        int((kept & (self.records["flags"] & PROMPT_TAIL > 0)).sum()), digest.hexdigest())

    def _counts(self, codes: np.ndarray) -> Counter:
        values, counts = np.unique(codes[codes > 0], return_counts=True)
        return Counter({self.strings[v - 1]: int(n) for v, n in zip(values.tolist(), counts.tolist())})

    def _error(self, position: int) -> DataError:
        """The error of a bad row, made again by tokenizing that row alone (the records keep only its reason)."""
        rows = self.files.read(self.rows[position:position + 1])
        error = self.tokenization.outcomes(rows, self.tokenizer)[0].error
        return error or DataError(f"{rows.sources[0]}: the cached record says this row is bad but it tokenizes "
                                  f"now; remove the cache ({self.notice}) and run again")


def select(
    datasets: list[str],
    tokenizer,
    tokenization,
    *,
    probs: list[float] | None = None,
    seed: int = 0,
    skip_bad_samples: bool = False,
    max_samples: int | None = None,
    split: str = "train",
    flag: str = "--dataset",
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
) -> Selection:
    """Open ``datasets``, tokenize every file once (or read its records from ``cache_dir``), and choose the rows
    the run uses as ``load_rows`` does: load-time bad rows (malformed JSON, not an object) raise or are counted,
    datasets are concatenated or mixed by ``probs``, then cut to ``max_samples``.

    ``tokenization``: ``SFTTokenization`` or ``PairTokenization`` (the flags), ``tokenizer`` its tokenizer;
    ``num_proc`` processes tokenize (default: the cores this process may use).
    """
    started = time.perf_counter()
    tokenization.check(tokenizer)
    files = open_datasets(datasets, split, flag)
    if probs is not None:
        check_probs(datasets, probs, flag)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tally = _Pass(tokenizer, tokenization, cache, num_proc or len(os.sched_getaffinity(0)),
                  stop_early=probs is None or len(datasets) < 2, skip=skip_bad_samples, wanted=max_samples)
    records = tally.run(files, started)
    parts, skipped_per = [], []
    for spec in files.per_spec:
        good, skipped = [], Counter()
        for file, first in spec:
            status = records[first:first + file.size]["status"]
            bad = np.flatnonzero(status == LOAD_BAD)
            if len(bad) and not skip_bad_samples:
                raise file.read(bad[:1])[0]
            for reason in records[first:first + file.size]["reason"][bad].tolist():
                skipped[tally.strings[reason - 1]] += 1
            good.append(np.flatnonzero((status != BLANK) & (status != LOAD_BAD) & (status != UNREAD)) + first)
        parts.append(np.concatenate(good))
        skipped_per.append(skipped)
    check_not_empty(datasets, [len(p) for p in parts], skipped_per, flag)
    rows = choose_rows(parts, probs, seed)[:max_samples]
    return Selection(files, rows, records[rows], tally.strings, sum(skipped_per, Counter()), tally.keys,
                     tally.notice(), tokenizer, tokenization)


class _Pass:
    """Records of every file: from the cache, else tokenized in chunks (in order; on a pool for large files)."""

    def __init__(self, tokenizer, tokenization, cache: Path, num_proc: int, stop_early: bool, skip: bool,
                 wanted: int | None):
        self.tokenizer, self.tokenization, self.cache, self.num_proc = tokenizer, tokenization, cache, num_proc
        self.stop_early, self.skip, self.wanted = stop_early, skip, wanted
        self.strings: list[str] = []
        self._codes: dict[str, int] = {}
        self.keys: list[str] = []
        self.cached_rows = self.tokenized_rows = 0
        self.seconds, self.opened, self.processes, self.saved = 0.0, 0.0, 1, False
        self._usable, self._stopped = 0, False
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._width = tokenization.width
        self._settings = _settings_key(tokenizer, tokenization)

    def run(self, files: DatasetFiles, started: float) -> np.ndarray:
        per_file = []
        try:
            for file in files.files:
                key = hashlib.sha256(json.dumps([self._settings, file.digest]).encode()).hexdigest()[:32]
                self.keys.append(key)
                per_file.append(self._records(file, key))
        finally:
            if self._pool is not None:  # one pool for every file of the pass: it takes seconds to start
                self._pool.shutdown(cancel_futures=True)
        self.opened = time.perf_counter() - started - self.seconds
        return np.concatenate(per_file) if per_file else np.zeros(0, record_dtype(self._width))

    def notice(self) -> str:
        """One line: rows read from the cache, rows tokenized (how long, how many processes), where it is."""
        parts = []
        if self.cached_rows:
            parts.append(f"{self.cached_rows} rows' lengths read from the cache in {self.opened:.1f} s (files "
                         "hashed and indexed), nothing tokenized again" if not self.tokenized_rows
                         else f"{self.cached_rows} rows' lengths from the cache")
        if self.tokenized_rows:
            parts.append(f"{self.tokenized_rows} rows tokenized in {self.seconds:.1f} s on {self.processes} "
                         f"process{'es' if self.processes > 1 else ''}"
                         + ("; lengths cached" if self.saved else " (a part of the data: not cached)"))
        return f"{'; '.join(parts)} ({self.cache})"

    def _records(self, file: RowFile, key: str) -> np.ndarray:
        if self._stopped:
            return _unread(file.size, self._width)
        cached = self._load(key, file.size)
        if cached is not None:
            self.cached_rows += _rows(cached)
            self._count(cached)
            return cached
        start = time.perf_counter()
        records, complete = self._tokenize(file)
        self.seconds += time.perf_counter() - start
        self.tokenized_rows += _rows(records)
        if complete:
            self._save(key, records)
        return records

    def _tokenize(self, file: RowFile) -> tuple[np.ndarray, bool]:
        """(records, whether the whole file was read): chunks in order, stopping early where ``_should_stop``."""
        windows = [(start, min(start + CHUNK_ROWS, file.size)) for start in range(0, file.size, CHUNK_ROWS)]
        records = _unread(file.size, self._width)
        for (start, stop), (chunk, strings) in zip(windows, self._chunks(file, windows)):
            records[start:stop] = self._recode(chunk, strings)
            self._count(records[start:stop])
            if self._should_stop(records[start:stop]):
                self._stopped = True
                return records, False
        return records, True

    def _chunks(self, file: RowFile, windows: list[tuple[int, int]]):
        """Each window's (records, strings), in order; on a pool of processes when the file is large."""
        processes = min(self.num_proc, len(windows))
        if self._pool is None and (file.size < PARALLEL_FROM or processes < 2):
            for start, stop in windows:
                yield measure(file.window(start, stop), self.tokenization, self.tokenizer)
            return
        if self._pool is None:
            self.processes = processes
            context = multiprocessing.get_context("spawn")  # the driver may hold threads (Ray): never fork it
            self._pool = concurrent.futures.ProcessPoolExecutor(
                processes, mp_context=context, initializer=_start_worker,
                initargs=(pickle.dumps(self.tokenizer), self.tokenization))
        pending = []
        try:
            for start, stop in windows:
                pending.append(self._pool.submit(_measure_in_worker, file.window(start, stop)))
                while len(pending) > 2 * self.processes:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            for future in pending:
                future.cancel()

    def _recode(self, chunk: np.ndarray, strings: list[str]) -> np.ndarray:
        """A chunk's kind and reason codes, from its own strings to this pass's."""
        table = np.array([0] + [self._code(s) for s in strings], dtype=np.uint16)
        chunk["kind"], chunk["reason"] = table[chunk["kind"]], table[chunk["reason"]]
        return chunk

    def _code(self, text: str) -> int:
        if text not in self._codes:
            self.strings.append(text)
            self._codes[text] = len(self.strings)
        return self._codes[text]

    def _count(self, records: np.ndarray) -> None:
        status = records["status"]
        self._usable += int(((status != BLANK) & (status != LOAD_BAD) & (status != UNREAD)).sum())

    def _should_stop(self, records: np.ndarray) -> bool:
        """Stop reading: a row that is not skippable, or (concatenated datasets) a bad row that will be raised,
        or the first --max_samples usable rows are read."""
        status = records["status"]
        if (status == FATAL).any():
            return True
        if not self.stop_early:
            return False
        if not self.skip and ((status == LOAD_BAD) | (status == BAD)).any():
            return True
        return self.wanted is not None and self._usable >= self.wanted

    def _load(self, key: str, size: int) -> np.ndarray | None:
        """The cached records of a file (memory-mapped), after mapping their strings into this pass's codes."""
        meta_path = self.cache / f"{key}.json"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            records = np.load(self.cache / f"{key}.npy", mmap_mode="r")
        except (OSError, ValueError):
            return None  # a broken entry is rebuilt
        if len(records) != size or records.dtype != record_dtype(self._width):
            return None
        if not meta["strings"]:
            return records
        return self._recode(np.array(records), meta["strings"])

    def _save(self, key: str, records: np.ndarray) -> None:
        """Records and their strings, each written to a temporary name and renamed; the .json last (it marks the
        entry complete). A cache that cannot be written is a warning, not an error."""
        try:
            self.cache.mkdir(parents=True, exist_ok=True)
            used = sorted((set(records["kind"].tolist()) | set(records["reason"].tolist())) - {0})
            table = np.zeros(len(self.strings) + 1, dtype=np.uint16)
            table[used] = np.arange(1, len(used) + 1)
            saved = records.copy()
            saved["kind"], saved["reason"] = table[records["kind"]], table[records["reason"]]
            tmp = self.cache / f".{key}.{os.getpid()}.npy"
            np.save(tmp, saved)
            os.replace(tmp, self.cache / f"{key}.npy")
            tmp = self.cache / f".{key}.{os.getpid()}.json"
            tmp.write_text(json.dumps({"strings": [self.strings[c - 1] for c in used], "rows": len(records),
                                       "version": CACHE_VERSION}))
            os.replace(tmp, self.cache / f"{key}.json")
            self.saved = True
        except OSError as err:
            import logging

            logging.getLogger(__name__).warning("could not cache tokenized lengths in %s (%s); the next run "
                                                "tokenizes again", self.cache, err)


def record_dtype(width: int) -> np.dtype:
    return np.dtype([("status", np.uint8), ("flags", np.uint8), ("kind", np.uint16), ("reason", np.uint16),
                     ("lengths", np.int32, (width,)), ("labels", np.int32, (width,))])


def _rows(records: np.ndarray) -> int:
    """Rows read (blank lines and rows not read are not rows)."""
    return int(((records["status"] != BLANK) & (records["status"] != UNREAD)).sum())


def _unread(size: int, width: int) -> np.ndarray:
    records = np.zeros(size, dtype=record_dtype(width))
    records["status"] = UNREAD
    return records


def measure(window: RowFile, tokenization, tokenizer) -> tuple[np.ndarray, list[str]]:
    """Records of every row of ``window`` and the strings their kind/reason codes (1-based) stand for."""
    values = window.read(np.arange(window.size))
    records = np.zeros(window.size, dtype=record_dtype(tokenization.width))
    strings: dict[str, int] = {}

    def code(text: str | None) -> int:
        return strings.setdefault(text, len(strings) + 1) if text else 0

    good = []
    for i, value in enumerate(values):
        if value is None:
            records[i]["status"] = BLANK
        elif isinstance(value, DataError):
            records[i]["status"], records[i]["reason"] = LOAD_BAD, code(value.reason)
        else:
            good.append(i)
    rows = Rows([values[i] for i in good], [window.source(i) for i in good])
    for i, outcome in zip(good, tokenization.outcomes(rows, tokenizer)):
        record = records[i]
        record["kind"] = code(outcome.kind)
        if outcome.error is not None:
            record["status"] = BAD if outcome.error.reason else FATAL
            record["reason"] = code(outcome.error.reason)
        elif outcome.dropped is not None:
            record["status"], record["reason"] = DROPPED, code(outcome.dropped)
        else:
            segments = tokenization.segments(outcome.sample, 0)
            record["status"] = KEPT
            record["flags"] = TRUNCATED * outcome.truncated + PROMPT_TAIL * outcome.prompt_tail
            record["lengths"] = [len(segment.tokens) for segment in segments]
            record["labels"] = [segment.num_labels for segment in segments]
    return records, list(strings)


_worker: dict = {}


def _start_worker(tokenizer: bytes, tokenization) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool already uses every core
    _worker["tokenizer"], _worker["tokenization"] = pickle.loads(tokenizer), tokenization


def _measure_in_worker(window: RowFile) -> tuple[np.ndarray, list[str]]:
    return measure(window, _worker["tokenization"], _worker["tokenizer"])


def _settings_key(tokenizer, tokenization) -> list:
    """What a file's records depend on besides its content: the tokenizer, the flags, this code."""
    return [CACHE_VERSION, _code_digest(), tokenizer_digest(tokenizer), type(tokenization).__name__,
            dataclasses.asdict(tokenization)]


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what tokenizing depends on: a fast tokenizer's whole serialized state (vocabulary, merges,
    normaliser, pre-tokenizer, post-processor, added tokens), its chat template and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else pickle.dumps(tokenizer).hex()
    parts = [type(tokenizer).__name__, state, repr(getattr(tokenizer, "chat_template", None))]
    parts += [repr(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _code_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _DATA_CODE:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]
