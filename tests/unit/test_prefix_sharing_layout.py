"""--prefix_sharing in the pure parts: the collated row as a literal, label counts, the planner's token counts
and efficiency on the benchmark mix, truncation, and the unshared layout left exactly as it was."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from openpack.core.batch import CHOSEN, PROMPT, REJECTED, Segment, collate_packed
from openpack.core.packing import plan_packs
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import Rows
from openpack.data.preference import PreferencePair, pair_segments, tokenize_pairs

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "packing.py"


def test_shared_row_literal():
    """The row drawn in core/batch.py: prompt 10 11 12, chosen 20 21, rejected 30 31 32."""
    batch = collate_packed(PreferencePair([10, 11, 12], [20, 21], [30, 31, 32], "x").shared_segments(4))
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]  # rejected continues the prompt, as unshared
    assert batch.labels.tolist() == [[-100, -100, -100, 20, 21, 30, 31, 32]]
    assert batch.label_source.tolist() == [0, 1, 2, 2, 3, 2, 5, 6]  # c0 and r0 both from the prompt's last token
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert batch.role.tolist() == [PROMPT, CHOSEN, REJECTED] and batch.sample_index.tolist() == [4, 4, 4]
    shared = batch.shared_prefix
    assert shared.prompt_segment.tolist() == [-1, 0, 0]
    assert shared.main_rows.tolist() == [0, 1, 2, 3, 4] and shared.main_cu_seqlens.tolist() == [0, 5]
    assert shared.cross_rows.tolist() == [5, 6, 7] and shared.cross_keys.tolist() == [0, 1, 2, 5, 6, 7]
    assert shared.cross_cu_seqlens_q.tolist() == [0, 3] and shared.cross_cu_seqlens_k.tolist() == [0, 6]
    assert batch.attention_kwargs()["shared_prefix"] is shared


def test_two_shared_pairs_restore_row_order():
    pairs = [PreferencePair([1, 2], [3], [4, 5], "a"), PreferencePair([6], [7, 8, 9], [10], "b")]
    batch = collate_packed([s for i, p in enumerate(pairs) for s in p.shared_segments(i)])
    shared = batch.shared_prefix
    assert shared.main_cu_seqlens.tolist() == [0, 3, 7]  # 1 2 3 | 6 7 8 9
    assert shared.cross_rows.tolist() == [3, 4, 9] and shared.cross_keys.tolist() == [0, 1, 3, 4, 5, 9]
    order = torch.cat([shared.main_rows, shared.cross_rows])
    assert torch.equal(order[shared.restore], torch.arange(batch.num_tokens))
    assert batch.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1, 2, 3, 1]]


def test_unshared_rows_are_collated_as_before():
    segments = PreferencePair([10, 11, 12], [20, 21], [30, 31, 32], "x").segments(0)
    batch = collate_packed(segments)
    assert batch.label_source is None and batch.shared_prefix is None
    assert "shared_prefix" not in batch.attention_kwargs()
    assert batch.labels.tolist() == [[-100, -100, 20, 21, -100, -100, -100, 30, 31, 32, -100]]


def test_a_response_needs_its_prompt_before_it():
    with pytest.raises(ValueError, match="no PROMPT segment of that sample"):
        collate_packed([Segment([1, 2], [True, True], 0, CHOSEN, after_prompt=True)])


def test_label_counts_and_planner_tokens():
    """Both layouts train on the same 2 + 3 tokens; the shared group is 3 + 2 + 3 = 8 tokens, not 5 + 6."""
    pair = PreferencePair([10, 11, 12], [20, 21], [30, 31, 32], "x")
    unshared, shared = pair_segments(False)(pair, 0), pair_segments(True)(pair, 0)
    assert [s.num_labels for s in unshared] == [2, 3] and [s.num_labels for s in shared] == [0, 2, 3]
    lengths = [tuple(len(s.tokens) for s in segs) for segs in (unshared, shared)]
    assert lengths == [(5, 6), (3, 2, 3)]
    plan = plan_packs([lengths[1]] * 3, max_tokens=16)
    assert plan.pack_tokens() == [16, 8]


def test_truncation_scores_the_same_tokens():
    """--max_len cuts each response at load time, so both layouts score the same (cut) tokens."""
    rows = Rows([{"prompt": "1+2=", "chosen": "3456789", "rejected": "4456789"},
                 {"prompt": "9+9=", "chosen": "18", "rejected": "17"}], ["a:1", "a:2"])
    pairs, report = tokenize_pairs(rows, build_demo_tokenizer(), max_len=8)
    assert report.truncated == 1 and len(pairs[0].chosen) == 4
    for i, pair in enumerate(pairs):
        unshared, shared = collate_packed(pair.segments(i)), collate_packed(pair.shared_segments(i))
        assert torch.equal(unshared.labels[unshared.loss_mask], shared.labels[shared.loss_mask])
        assert max(pair.lengths()) <= 8


def _benchmark_lengths(pairs: int):
    spec = importlib.util.spec_from_file_location("benchmark_packing", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.generate_lengths(pairs, seed=0)


def test_shared_groups_pack_at_99_percent_on_the_benchmark_mix():
    """The planner sees prompt + chosen + rejected per pair (22.6% fewer tokens, as ANCHORS says) and still
    fills >= 99% of every 16384-token row."""
    lengths = _benchmark_lengths(20_000)
    shared = [[int(p), int(c), int(r)] for p, c, r in zip(lengths.prompt, lengths.chosen, lengths.rejected)]
    plan = plan_packs(shared, max_tokens=16384, pack_multiple=8)
    assert plan.efficiency >= 0.99
    unshared_tokens = int(lengths.dpo_rows().sum())
    assert sum(plan.pack_tokens()) == unshared_tokens - int(lengths.prompt.sum())
    assert 1 - sum(plan.pack_tokens()) / unshared_tokens == pytest.approx(0.226, abs=0.005)
