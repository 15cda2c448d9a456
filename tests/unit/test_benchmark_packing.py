"""The packing benchmark's data follows the ANCHORS length mix, and global BFD beats TRL's block BFD.

The benchmark is a script, not a package module, so it is loaded from its path.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "packing.py"
PAIRS = 2000


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_packing", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


@pytest.fixture(scope="module")
def lengths():
    return bench.generate_lengths(PAIRS, seed=0)


def test_lengths_respect_caps(lengths):
    for segment in (lengths.prompt, lengths.chosen, lengths.rejected):
        assert segment.shape == (PAIRS,)
        assert segment.min() >= 1 and segment.max() <= 1500
    assert lengths.prompt.min() >= 5
    assert lengths.dpo_rows().max() <= 2048
    assert lengths.sft_rows().max() <= 2048


def test_lengths_are_seeded(lengths):
    again = bench.generate_lengths(PAIRS, seed=0)
    other = bench.generate_lengths(PAIRS, seed=1)
    assert np.array_equal(again.dpo_rows(), lengths.dpo_rows())
    assert not np.array_equal(other.dpo_rows(), lengths.dpo_rows())


def test_padding_counts_the_longest_row_of_each_micro_batch():
    """Two pairs of rows (3, 5) and (2, 4), batch 2: 4 rows padded to 5 -> 14 / 20."""
    rows = np.array([[3, 5], [2, 4]])
    assert bench.padded_efficiency(rows, batch=2) == pytest.approx(14 / 20)
    # A last partial batch counts only its own rows: [4, 2] -> 6 / 8, then [1] -> 1 / 1.
    assert bench.padded_efficiency(np.array([4, 2, 1]), batch=2) == pytest.approx(7 / 9)


@pytest.mark.slow  # importing TRL (and transformers) takes ~8 s on 2 cores
def test_openpack_sft_efficiency_at_least_trl_bfd(lengths):
    pytest.importorskip("trl")
    rows = lengths.sft_rows()
    ours = bench.run_openpack([[int(n)] for n in rows], "SFT", 4096)
    trl = bench.run_trl(rows, 4096)
    assert ours.efficiency >= trl.efficiency
    assert int(ours.pack_tokens.sum()) == int(trl.pack_tokens.sum()) == int(rows.sum())
