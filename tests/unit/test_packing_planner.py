"""Planner properties (hypothesis) and efficiency on a long-tailed length distribution."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from openpack.core.packing import (
    GroupTooLongError,
    deal_to_ranks,
    packing_report,
    plan_packs,
    shuffled_epoch,
    truncate_segments,
)

groups_strategy = st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=3), min_size=1, max_size=200)


@settings(max_examples=200, deadline=None)
@given(groups=groups_strategy, cap=st.integers(60, 256))
def test_every_group_placed_once_whole_and_cap_respected(groups, cap):
    cap = max(cap, max(sum(g) for g in groups))
    plan = plan_packs(groups, cap)
    placed = [g for pack in plan.packs for g in pack]
    assert sorted(placed) == list(range(len(groups)))  # once each; a group is one index, never split
    assert all(t <= cap for t in plan.pack_tokens())
    assert all(plan.group_lengths[g] == tuple(groups[g]) for g in range(len(groups)))


@settings(max_examples=200, deadline=None)
@given(groups=groups_strategy, ranks=st.integers(1, 8))
@example(groups=[[40, 60], [41, 60], [41, 60]], ranks=2)
def test_equal_microbatch_counts_per_rank(groups, ranks):
    if len(groups) < ranks:
        return
    # Splitting packs reaches every count from best-fit's to one group per pack, and no further: with three
    # groups of 101 tokens under a cap of 200 there are always three packs, which 2 ranks cannot share equally
    # (hypothesis found that case). Then the planner must refuse, naming the fix.
    fewest = len(plan_packs(groups, 200).packs)
    if not any(count % ranks == 0 for count in range(fewest, len(groups) + 1)):
        with pytest.raises(ValueError, match="cannot fill a multiple of"):
            plan_packs(groups, 200, pack_multiple=ranks)
        return
    plan = plan_packs(groups, 200, pack_multiple=ranks)
    per_rank = deal_to_ranks(plan.pack_tokens(), ranks)
    assert len({len(p) for p in per_rank}) == 1
    assert sorted(p for r in per_rank for p in r) == list(range(len(plan.packs)))
    assert all(t <= 200 for t in plan.pack_tokens())


@settings(max_examples=50, deadline=None)
@given(groups=groups_strategy, seed=st.integers(0, 2**31))
def test_deterministic_for_a_seed(groups, seed):
    a, b = plan_packs(groups, 200), plan_packs(groups, 200)
    assert a.packs == b.packs
    assert shuffled_epoch(len(a.packs), seed, 3) == shuffled_epoch(len(b.packs), seed, 3)


def test_pack_order_changes_between_epochs():
    assert shuffled_epoch(100, seed=1, epoch=0) != shuffled_epoch(100, seed=1, epoch=1)
    assert sorted(shuffled_epoch(100, seed=1, epoch=1)) == list(range(100))


def long_tailed_lengths(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.minimum(1 + rng.lognormal(np.log(300), 1.0, n).astype(int), 4096).tolist()


def test_efficiency_at_least_99_percent_on_long_tail():
    lengths = long_tailed_lengths(12_000)
    plan = plan_packs([[n] for n in lengths], max_tokens=8192, pack_multiple=8)
    per_rank = deal_to_ranks(plan.pack_tokens(), 8)
    report = packing_report(plan, per_rank)
    assert report["groups"] == 12_000
    assert report["efficiency"] >= 0.99, report
    assert report["rank_spread"] < 0.01, report


def test_pairs_efficiency_on_long_tail():
    lengths = long_tailed_lengths(20_000, seed=1)
    pairs = [lengths[i:i + 2] for i in range(0, len(lengths), 2)]
    plan = plan_packs(pairs, max_tokens=16384)
    assert plan.efficiency >= 0.99


def test_overflow_policies():
    groups = [[5], [30, 4], [6]]
    with pytest.raises(GroupTooLongError, match="group 1 has 34 tokens.*truncate"):
        plan_packs(groups, 20)
    dropped = plan_packs(groups, 20, overflow="drop")
    assert dropped.dropped == [1] and sorted(g for p in dropped.packs for g in p) == [0, 2]
    truncated = plan_packs(groups, 20, overflow="truncate")
    assert truncated.truncated == [1] and truncated.group_lengths[1] == (16, 4)
    assert packing_report(truncated)["truncated"] == 1


def test_truncate_cuts_longest_segments_first():
    """Water-filling: level h with sum(min(n, h)) <= budget; 10,3,8 into 15 -> h=6, spare 0."""
    assert truncate_segments([10, 3, 8], 15) == (6, 3, 6)
    assert truncate_segments([10, 3, 8], 16) == (7, 3, 6)
    assert sum(truncate_segments([1000, 1, 999], 1001)) == 1001


def test_split_to_rank_multiple_and_impossible_case():
    plan = plan_packs([[10], [10], [10]], 100, pack_multiple=2)  # one pack of 3 -> split into 2
    assert len(plan.packs) == 2
    with pytest.raises(ValueError, match="cannot fill a multiple of 4"):
        plan_packs([[10], [10], [10]], 100, pack_multiple=4)


def test_karmarkar_karp_balances_better_than_round_robin():
    tokens = [100, 90, 80, 70, 60, 50, 40, 30]
    per_rank = deal_to_ranks(tokens, 2)
    loads = [sum(tokens[p] for p in r) for r in per_rank]
    assert loads == [260, 260]
