"""The built-in demo task: two-digit addition with an exactly checkable answer.

Used by ``train_sft``, ``train_dpo`` and the RL commands when the user gives
no ``--pretrain``/``--dataset``, so every command runs offline on a laptop CPU
and shows learning, not just a falling loss. A sample is

    {"prompt": "07+35=", "response": "42"}

with both operands in 0..99 (10,000 problems), always written with two digits,
and the sum written as a reader expects (no padding, most significant digit
first). The fixed-width operands are the trade-off that makes the task fast
to learn: every digit sits at the same distance from "=" in every prompt, so
rotary positions line the columns up. Measured on 2 CPU cores with a 3-layer,
width-128 Llama (0.46M parameters), chat template, batch 64, AdamW at 3e-3:
greedy held-out exact match goes 0% -> 85% in 300 steps (~35 s) and 0% ->
99.6% in 90 s (799 steps); unpadded operands ("7+35=") reach only 74% after
600 steps. Reversing the answer's digits or padding it to three ("042")
learns faster still (98-99% at 300 steps) but reads oddly.

The split is by a hash of the prompt, not by position: about 1 problem in 10
is ``test``, never ``train``, for every ``n`` and ``seed``, so held-out
accuracy measures generalisation rather than recall.

Two answer forms, so that DPO has something to teach that SFT does not. The
SFT demo's data answers in the bare form ``"42"`` or the wordy form
``"it is 42"`` (``WORDY_SHARE``, 7 in 10), so an SFT model answers right but
wordily under greedy decoding. The preference pairs always choose the bare
right answer and reject either the wordy form of it or a plausible mistake:
the preference for the bare form is in no SFT row. With the demos' defaults
(seed 42, 2 CPU cores, 2026-11-25) SFT gives 98.2% right answers, 0.6% of them bare;
DPO with its NLL term then gives 99.0% right, every one bare. Without the NLL term
DPO also makes every answer bare but only 74.0% right: it lowers the rejected
answers' likelihood faster than it raises the chosen ones' (docs/dpo.md).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import zlib

MAX_OPERAND = 99
WORDY_FORM = "it is {}"  # the SFT data's other answer form; the preference pairs reject it
WORDY_SHARE = 0.7  # share of SFT demo answers in the wordy form
TEST_FRACTION_DENOMINATOR = 10  # crc32(prompt) % 10 == 0 -> test
SPLITS = ("train", "test")


def _prompt(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def _split_of(a: int, b: int) -> str:
    # crc32 rather than hash(): stable across processes and PYTHONHASHSEED.
    return "test" if zlib.crc32(_prompt(a, b).encode()) % TEST_FRACTION_DENOMINATOR == 0 else "train"


def _problems(split: str) -> list[tuple[int, int]]:
    if split not in SPLITS:
        raise ValueError(f"demo split must be one of {SPLITS}, got {split!r}")
    operands = range(MAX_OPERAND + 1)
    return [(a, b) for a in operands for b in operands if _split_of(a, b) == split]


def demo_samples(split: str, n: int, seed: int = 0, wordy_share: float = 0.0) -> list[dict]:
    """``n`` samples ``{"prompt": f"{a:02d}+{b:02d}=", "response": str(a + b)}`` from ``split``.

    Deterministic for ``(split, n, seed, wordy_share)``. Problems are drawn without
    replacement in a seeded order; past the split's size (~9,000 train,
    ~1,000 test) the order is reshuffled and repeats, like another epoch.
    A seeded ``wordy_share`` of the responses take the wordy form (``"it is 42"``).
    """
    if n < 0:
        raise ValueError(f"demo_samples: n must be >= 0, got {n}")
    pool = _problems(split)
    rng = random.Random(f"demo:{split}:{seed}")  # str seeds hash with sha512: stable everywhere
    order: list[tuple[int, int]] = []
    while len(order) < n:
        epoch = list(pool)
        rng.shuffle(epoch)
        order.extend(epoch)
    forms = random.Random(f"demo-forms:{split}:{seed}")
    return [{"prompt": _prompt(a, b), "response": _answer(a + b, forms.random() < wordy_share)} for a, b in order[:n]]


def _answer(total: int, wordy: bool) -> str:
    return WORDY_FORM.format(total) if wordy else str(total)


def _wrong_answers(a: int, b: int) -> list[str]:
    """Plausible mistakes for ``a+b``, each different from the right answer."""
    right = a + b
    no_carry = (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10  # 47+38 -> 75
    swapped = str(right)[::-1]
    candidates = [str(right + 1), str(right - 1) if right > 0 else None, str(no_carry)]
    if len(swapped) > 1 and not swapped.startswith("0"):
        candidates.append(swapped)  # 47+38=85 -> 58
    distinct = dict.fromkeys(c for c in candidates if c is not None and c != str(right))
    return list(distinct)


def demo_preference_pairs(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` pairs ``{"prompt", "chosen", "rejected"}`` on the problems of ``demo_samples``.

    ``chosen`` is the right sum in the bare form; ``rejected`` is, with even
    odds picked by the seed, the same sum in the wordy form (``"it is 85"``)
    or one plausible mistake: off by one, the digits swapped, or the carry
    dropped (``47+38=`` -> ``86``, ``84``, ``58`` or ``75``). ``rejected !=
    chosen`` always, so a DPO loss has a signal on every pair.
    """
    rng = random.Random(f"demo-pairs:{split}:{seed}")
    pairs = []
    for sample in demo_samples(split, n, seed):
        a, b = (int(x) for x in sample["prompt"].rstrip("=").split("+"))
        wordy = rng.random() < 0.5
        rejected = _answer(a + b, wordy=True) if wordy else rng.choice(_wrong_answers(a, b))
        pairs.append({"prompt": sample["prompt"], "chosen": sample["response"], "rejected": rejected})
    return pairs


def answer_rates(predictions: list[str], sums: list[str]) -> tuple[float, float]:
    """(share of right answers in either form, share that are the right answer in the bare form)."""
    right = exact_match([p.strip().removeprefix(WORDY_FORM.format("")) for p in predictions], sums)
    return right, exact_match(predictions, sums)


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Fraction of predictions equal to their reference, ignoring surrounding whitespace."""
    if len(predictions) != len(references):
        raise ValueError(f"exact_match: {len(predictions)} predictions but {len(references)} references")
    if not references:
        raise ValueError("exact_match: no references to score")
    hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references))
    return hits / len(references)


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> None:
    """Write one JSON object per line; a reader never sees a half-written file (temp file, then rename)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".jsonl")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; give the mode a plain open() would
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
