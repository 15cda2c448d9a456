"""Packing efficiency: naive padding vs TRL's block-wise BFD vs openpack's global BFD.

Measures real tokens / computed slots on the ANCHORS benchmark length mix
(long-tailed preference data) for two workloads:

* SFT rows (prompt + chosen): padding in batches of 8, TRL's
  ``pack_dataset(strategy="bfd")`` and ``openpack.core.packing.plan_packs``.
* DPO pairs (chosen and rejected must share a pack): padding 8 pairs per
  micro-batch to the longest of its 16 rows, and ``plan_packs`` on two-segment
  groups. TRL has no pair packing (its DPO ``padding_free`` pads anyway).

The trade-off: TRL packs inside ``datasets.map`` blocks of 1000 rows, which
is cheap and streams, but leaves one half-empty tail pack per block; openpack
sorts the whole dataset once (O(N log C)) and leaves a single tail. Padding
costs nothing to plan but computes ~2.4x the real tokens on DPO pairs.

    python benchmarks/packing.py [--pairs 20000] [--seed 0] [--caps 4096,8192] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from openpack.core.packing import plan_packs

# The ANCHORS "benchmark length mix": shared by every benchmark so numbers compare.
PROMPT_BASE, PROMPT_MEDIAN, PROMPT_SIGMA = 5, 150, 0.9
RESPONSE_BASE, RESPONSE_MEDIAN, RESPONSE_SIGMA = 1, 200, 0.8
SEGMENT_CAP = 1500  # every prompt and every response
ROW_CAP = 2048  # prompt + one response
PAD_BATCH = 8  # rows (SFT) or pairs (DPO) per padded micro-batch


@dataclass
class PairLengths:
    """Token counts of ``n`` preference pairs; arrays of shape (n,)."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray

    def sft_rows(self) -> np.ndarray:
        """(n,) lengths of prompt + chosen."""
        return self.prompt + self.chosen

    def dpo_rows(self) -> np.ndarray:
        """(n, 2) lengths of [prompt + chosen, prompt + rejected]."""
        return np.stack([self.prompt + self.chosen, self.prompt + self.rejected], axis=1)


@dataclass
class Result:
    method: str
    data: str
    cap: int | None  # None: padding does not depend on the cap
    rows: int  # packs, or padded rows for naive padding
    efficiency: float
    seconds: float | None  # None: nothing to plan
    pack_tokens: np.ndarray | None = None  # (packs,) real tokens per pack; None for padding


def mix_description() -> str:
    return (
        f"prompt = {PROMPT_BASE} + lognormal(median {PROMPT_MEDIAN}, sigma {PROMPT_SIGMA}); "
        f"response = {RESPONSE_BASE} + lognormal(median {RESPONSE_MEDIAN}, sigma {RESPONSE_SIGMA}); "
        f"each capped at {SEGMENT_CAP}; prompt + response capped at {ROW_CAP} (response cut); "
        "rounded to whole tokens"
    )


def describe_groups(lengths: PairLengths) -> str:
    """Group sizes: a gap in a pack smaller than the smallest group can never be filled."""
    parts = []
    for name, sizes in (("SFT row", lengths.sft_rows()), ("DPO pair", lengths.dpo_rows().sum(axis=1))):
        parts.append(f"{name} min {int(sizes.min())}, median {int(np.median(sizes))}, "
                     f"mean {sizes.mean():.0f}, {int((sizes < 200).sum())} under 200")
    return "group tokens: " + "; ".join(parts)


def _lognormal_tokens(rng, base: int, median: int, sigma: float, n: int) -> np.ndarray:
    draws = base + np.rint(rng.lognormal(np.log(median), sigma, n))
    return np.minimum(draws, SEGMENT_CAP).astype(np.int64)


def generate_lengths(pairs: int, seed: int = 0) -> PairLengths:
    """The ANCHORS benchmark length mix, drawn from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    prompt = _lognormal_tokens(rng, PROMPT_BASE, PROMPT_MEDIAN, PROMPT_SIGMA, pairs)
    chosen = _lognormal_tokens(rng, RESPONSE_BASE, RESPONSE_MEDIAN, RESPONSE_SIGMA, pairs)
    rejected = _lognormal_tokens(rng, RESPONSE_BASE, RESPONSE_MEDIAN, RESPONSE_SIGMA, pairs)
    room = ROW_CAP - prompt  # >= 548 since prompt <= 1500, so responses stay >= 1
    return PairLengths(prompt, np.minimum(chosen, room), np.minimum(rejected, room))


def padded_efficiency(rows: np.ndarray, batch: int = PAD_BATCH) -> float:
    """Real / computed tokens when ``batch`` groups (rows of ``rows``) are padded to their longest segment.

    ``rows`` is (n,) for SFT or (n, 2) for DPO pairs: a micro-batch of 8 pairs
    is 16 rows, all padded to the longest. The last micro-batch keeps its size.
    """
    rows = rows.reshape(len(rows), -1)
    computed = 0
    for start in range(0, len(rows), batch):
        block = rows[start:start + batch]
        computed += block.size * int(block.max())
    return float(rows.sum()) / computed


def trl_bfd(rows: np.ndarray, cap: int) -> tuple[np.ndarray, float]:
    """((packed rows,) real tokens per packed row, seconds) for TRL's ``pack_dataset(strategy="bfd")``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Dataset, disable_progress_bars
    from trl import pack_dataset

    disable_progress_bars()
    offsets = np.concatenate([[0], np.cumsum(rows)])
    if offsets[-1] >= 2**31:  # pa.ListArray has int32 offsets
        raise ValueError(f"{offsets[-1]} tokens overflow an Arrow list; use fewer --pairs")
    offsets = offsets.astype(np.int32)
    ones = pa.array(np.ones(int(offsets[-1]), dtype=np.int64))  # dummy token ids
    dataset = Dataset.from_dict({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), ones)})
    start = time.perf_counter()
    packed = pack_dataset(dataset, seq_length=cap, strategy="bfd")  # TRL's default map: blocks of 1000
    seconds = time.perf_counter() - start
    pack_tokens = pc.list_value_length(packed.data.table.column("input_ids")).to_numpy()
    return pack_tokens.astype(np.int64), seconds


def run_trl(rows: np.ndarray, cap: int) -> Result:
    pack_tokens, seconds = trl_bfd(rows, cap)
    kept = int(pack_tokens.sum())
    if kept != int(rows.sum()):  # rows <= ROW_CAP <= cap, so bfd must truncate nothing
        raise RuntimeError(f"TRL kept {kept} of {int(rows.sum())} tokens at cap {cap}")
    efficiency = kept / (len(pack_tokens) * cap)
    return Result("TRL pack_dataset bfd", "SFT", cap, len(pack_tokens), efficiency, seconds, pack_tokens)


def run_openpack(groups: list[list[int]], data: str, cap: int) -> Result:
    start = time.perf_counter()
    plan = plan_packs(groups, max_tokens=cap)
    seconds = time.perf_counter() - start
    pack_tokens = np.array(plan.pack_tokens(), dtype=np.int64)
    return Result("openpack plan_packs", data, cap, len(plan.packs), plan.efficiency, seconds, pack_tokens)


def sft_results(lengths: PairLengths, caps: list[int]) -> list[Result]:
    rows = lengths.sft_rows()
    groups = [[int(n)] for n in rows]
    results = [Result(f"naive padding, {PAD_BATCH} rows", "SFT", None, len(rows), padded_efficiency(rows), None)]
    for cap in caps:
        results += [run_trl(rows, cap), run_openpack(groups, "SFT", cap)]
    return results


def dpo_results(lengths: PairLengths, caps: list[int]) -> list[Result]:
    rows = lengths.dpo_rows()
    groups = rows.tolist()
    padded = Result(f"naive padding, {PAD_BATCH} pairs", "DPO pairs", None, rows.size, padded_efficiency(rows), None)
    return [padded] + [run_openpack(groups, "DPO pairs", cap) for cap in caps]


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| method | data | cap | packs/rows | efficiency (%) | planning time (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        cap = "—" if r.cap is None else str(r.cap)
        seconds = "—" if r.seconds is None else f"{r.seconds:.3f}"
        lines.append(f"| {r.method} | {r.data} | {cap} | {r.rows} | {100 * r.efficiency:.2f} | {seconds} |")
    return "\n".join(lines)


def compare_to_trl(results: list[Result], caps: list[int]) -> bool:
    """Print openpack / TRL SFT efficiency per cap; True when ours is >= TRL's at every cap."""
    ok = True
    for cap in caps:
        ours, trl = (next(r for r in results if r.data == "SFT" and r.cap == cap and r.method == m)
                     for m in ("openpack plan_packs", "TRL pack_dataset bfd"))
        passed = ours.efficiency >= trl.efficiency
        ok &= passed
        print(f"cap {cap}: openpack / TRL efficiency = {ours.efficiency / trl.efficiency:.4f}x; "
              f"packs {ours.rows} vs {trl.rows}; openpack >= TRL: {'yes' if passed else 'NO'}")
    return ok


def print_waste(results: list[Result], tail_fill: float = 0.9) -> None:
    """Where each packing's empty slots are: tail packs under ``tail_fill`` full vs the rest."""
    for r in results:
        if r.pack_tokens is None:
            continue
        free = r.cap - r.pack_tokens
        tail = r.pack_tokens < tail_fill * r.cap
        lower_bound = -(-int(r.pack_tokens.sum()) // r.cap)  # ceil(real / cap) packs
        print(f"{r.method}, {r.data}, cap {r.cap}: {r.rows} packs (lower bound {lower_bound}), "
              f"{int(free.sum())} free slots; packs under {tail_fill:.0%} full: {int(tail.sum())}, "
              f"holding {int(free[tail].sum())}; the other {int((~tail).sum())} packs: "
              f"{free[~tail].mean():.1f} each on average")


def check_padding_anchor(results: list[Result]) -> None:
    """ANCHORS: padding 8 pairs to the longest row is 41% real (2.43x) on this mix."""
    padded = next(r for r in results if r.data == "DPO pairs" and r.cap is None)
    print(f"DPO naive padding at {PAD_BATCH} pairs: {100 * padded.efficiency:.1f}% real, "
          f"{1 / padded.efficiency:.2f}x computed / real (ANCHORS: 41%, 2.43x)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000, help="preference pairs to generate")
    parser.add_argument("--seed", type=int, default=0, help="seed of np.random.default_rng")
    parser.add_argument("--caps", default="4096,8192", help="comma-separated pack caps (max_tokens / seq_length)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    lengths = generate_lengths(args.pairs, args.seed)
    print(f"data: {args.pairs} pairs, seed {args.seed}; {mix_description()}")
    print(describe_groups(lengths))
    print(f"real tokens: SFT {int(lengths.sft_rows().sum())}, DPO pairs {int(lengths.dpo_rows().sum())}")
    results = sft_results(lengths, caps) + dpo_results(lengths, caps)
    table = markdown_table(results)
    print(table)
    print(f"naive padding does not depend on the cap: every row is <= {ROW_CAP} tokens")
    print_waste(results)
    check_padding_anchor(results)
    ok = compare_to_trl(results, caps)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
