"""Where each element of a ``.json`` file's top-level array lies, found without parsing the file or holding its rows.

A ``.json`` dataset ``[{...}, {...}, ...]`` is then read like JSONL: the driver keeps each element's byte span and
the line it starts on (24 bytes an element, against about 1 KB for the parsed dict), and a row is one ``pread`` of
its span, parsed alone. The scan reads the file once, in 4 MiB blocks, and finds the structure with numpy, never
byte by byte in Python:

    [ {"prompt": "a,b", "x": [1, 2]} , {"prompt": "q\\"]"} ]
    ^                                ^                     ^     depth-1 separators: the array's ends and the
                                                                  commas between its elements
      quotes not preceded by an odd run of backslashes open and close strings; a bracket, brace or comma
      inside a string is text, outside it moves the depth (or, at depth 1, separates elements)

A broken element is then one bad row, named by index and line and skippable with ``--skip_bad_samples``, where a
whole-file ``json.loads`` failed the file. Brackets or quotes that never balance leave no elements to name: that
fails the file, with the line where the array opened.
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass

import numpy as np

BLOCK = 1 << 22  # bytes read at a time: the scan's memory is a few times this, plus 24 bytes an element

# Byte classes: 1 opens ([ {), -1 closes (] }), 2 is a comma; quotes (34), backslashes (92) and newlines (10) apart.
_CLASS = np.zeros(256, dtype=np.int8)
_CLASS[[ord("["), ord("{")]] = 1
_CLASS[[ord("]"), ord("}")]] = -1
_CLASS[ord(",")] = 2
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[ord(" "), ord("\t"), ord("\n"), ord("\r")]] = True


class ArrayStructureError(ValueError):
    """The file's array does not balance, so no element can be told from the next; ``line`` is where to look."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


@dataclass
class ArrayIndex:
    """``spans[k]`` = (start, stop) byte offsets of element k's text (whitespace around it included);
    ``lines[k]`` = the 1-based line its span starts on; ``digest`` = sha256 of the whole file."""

    digest: str
    spans: np.ndarray  # [n, 2] int64
    lines: np.ndarray  # [n] int64


@dataclass
class _Scan:
    """What one block hands the next: string state, depth, the line count, and whether the array has closed."""

    in_string: bool = False
    backslashes: int = 0  # the run of backslashes the last block ended with
    depth: int = 0
    newlines: int = 0
    offset: int = 0
    opened_line: int = 1
    closed: bool = False  # the array's closing bracket has been seen
    after_close: bool = False  # something other than whitespace follows it


def index_json_array(path: str) -> ArrayIndex | None:
    """The elements of the array ``path`` holds (its first non-blank byte is ``[``), or None when the array is
    followed by more content (JSONL whose rows are arrays: the caller reads it by lines).

    Raises ArrayStructureError when the array never closes (an unclosed string, a missing bracket, a file cut
    short). A stray closing bracket closes the array early: the content after it makes the file JSONL, whose lines
    are then reported one by one.
    """
    digest, scan, separators, lines = hashlib.sha256(), _Scan(), [], []
    with open(path, "rb") as f:
        first = True
        while block := f.read(BLOCK):
            digest.update(block)
            data = np.frombuffer(block, dtype=np.uint8)
            if first and block.startswith(codecs.BOM_UTF8):
                data = data.copy()
                data[:3] = ord(" ")  # the byte-order mark is not content; offsets stay the file's
            first = False
            found, found_lines = _scan_block(data, scan)
            separators.append(found)
            lines.append(found_lines)
            scan.offset += len(block)
    if scan.after_close:
        return None
    if not scan.closed:
        what = "a string never closes" if scan.in_string else f"{scan.depth} bracket(s) or brace(s) never close"
        raise ArrayStructureError(f"the array opened at line {scan.opened_line} does not end: {what} (is the file "
                                  "cut short?)", scan.opened_line)
    at, at_lines = np.concatenate(separators), np.concatenate(lines)
    spans = np.stack([at[:-1] + 1, at[1:]], axis=1)
    if len(spans) == 1 and _blank(path, spans[0]):
        spans = spans[:0]  # []
    return ArrayIndex(digest.hexdigest(), spans, at_lines[:len(spans)])


def _scan_block(data: np.ndarray, scan: _Scan) -> tuple[np.ndarray, np.ndarray]:
    """The file offsets of the depth-1 separators in ``data`` (the array's brackets, the commas between its
    elements) and the line each is on; updates ``scan`` for the next block."""
    newline_at = np.flatnonzero(data == 10)
    if scan.closed:
        scan.after_close |= not bool(_WHITESPACE[data].all())
        scan.newlines += len(newline_at)
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    quotes = np.flatnonzero(data == 34)
    quotes = quotes[~_escaped(data, quotes, scan.backslashes if scan.in_string else 0)]
    marks = np.flatnonzero(_CLASS[data])
    outside = (np.searchsorted(quotes, marks) + scan.in_string) % 2 == 0
    marks = marks[outside]
    kinds = _CLASS[data[marks]].astype(np.int64)
    steps = np.where(kinds == 2, 0, kinds)
    depth_before = scan.depth + np.cumsum(steps) - steps
    line_of = scan.newlines + 1 + np.searchsorted(newline_at, marks)
    closes = np.flatnonzero((depth_before == 1) & (steps == -1))
    stop = int(closes[0]) + 1 if len(closes) else len(marks)
    separator = ((depth_before == 0) & (steps == 1)) | ((depth_before == 1) & (kinds != 1))
    separator[stop:] = False
    if scan.depth == 0 and separator.any():  # the array opens in this block: its first separator is the [
        scan.opened_line = int(line_of[np.flatnonzero(separator)[0]])
    if len(closes):
        scan.closed = True
        rest = data[int(marks[closes[0]]) + 1:]
        scan.after_close = not bool(_WHITESPACE[rest].all())
    else:
        scan.depth = int(depth_before[-1] + steps[-1]) if len(marks) else scan.depth
        scan.in_string = bool((len(quotes) + scan.in_string) % 2)
        tail = np.flatnonzero(data != 92)
        scan.backslashes = len(data) - 1 - int(tail[-1]) if len(tail) else scan.backslashes + len(data)
    scan.newlines += len(newline_at)
    return marks[separator].astype(np.int64) + scan.offset, line_of[separator].astype(np.int64)


def _escaped(data: np.ndarray, quotes: np.ndarray, carried: int) -> np.ndarray:
    """Which ``quotes`` follow an odd run of backslashes (``carried`` = the run the previous block ended with)."""
    count = np.zeros(len(quotes), dtype=np.int64)
    alive, back = np.arange(len(quotes)), 1
    while len(alive):  # runs are short: one pass per backslash of the longest run
        at = quotes[alive] - back
        count[alive[at < 0]] += carried
        alive, at = alive[at >= 0], at[at >= 0]
        alive = alive[data[at] == 92]
        count[alive] += 1
        back += 1
    return count % 2 == 1


def _blank(path: str, span: np.ndarray) -> bool:
    with open(path, "rb") as f:
        f.seek(int(span[0]))
        return not f.read(int(span[1] - span[0])).strip()
