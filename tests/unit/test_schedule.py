"""The run plan: every rank's steps, planned once from lengths (by the Ray driver, or by each torchrun rank)."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from openpack.core.schedule import Batching, epoch_steps, plan_run, plan_scoring
from openpack.data.prepared import Prepared
from openpack.trainers.run import own_items, plan_ranks

rng = random.Random(0)
LENGTHS = [(rng.randint(3, 60), rng.randint(3, 60)) for _ in range(50)]  # pairs: (chosen, rejected)
LABELS = [(a - 2, b - 2) for a, b in LENGTHS]


def plan(world, batching=Batching(max_tokens=160), **kw):
    args = {"train_batch_size": 8, "max_epochs": 2, "max_steps": None, "seed": 1} | kw
    return plan_run(LENGTHS, LABELS, world, batching, **args)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_split_each_step_exactly_once_with_equal_counts(world):
    ranks = plan(world)
    steps = [ids for epoch in range(2) for ids in epoch_steps(50, 8, 1, epoch)]
    assert all(len(r) == len(steps) == 12 for r in ranks)
    for s, ids in enumerate(steps):
        mine = [rank[s] for rank in ranks]
        assert sorted(i for step in mine for mb in step.micro_batches for i in mb) == sorted(ids)
        assert len({len(step.micro_batches) for step in mine}) == 1  # every rank the same number
        assert all(sum(map(sum, (LENGTHS[i] for i in mb))) <= 160 for step in mine for mb in step.micro_batches)
        totals = mine[0]
        assert totals.samples == 8 and totals.rows == world * len(totals.micro_batches)
        assert totals.real_tokens == sum(map(sum, (LENGTHS[i] for i in ids)))
        assert totals.label_tokens == (sum(LABELS[i][0] for i in ids), sum(LABELS[i][1] for i in ids))
        assert (totals.epoch, totals.index) == (s // 6, s % 6)


def test_the_steps_do_not_depend_on_world_size_or_batching():
    def samples(ranks):
        return [sorted(i for rank in ranks for mb in rank[s].micro_batches for i in mb) for s in range(len(ranks[0]))]

    assert samples(plan(1)) == samples(plan(4)) == samples(plan(2, Batching(micro_batch_size=2)))


def test_max_steps_and_fixed_micro_batches():
    ranks = plan(2, Batching(micro_batch_size=2), max_steps=7)
    assert [len(r) for r in ranks] == [7, 7]
    assert all(len(step.micro_batches) == 2 and step.packing_efficiency is None for r in ranks for step in r)
    with pytest.raises(ValueError, match="multiple of 6"):
        plan(2, Batching(micro_batch_size=3))


def test_scoring_covers_every_sample_once():
    shares = plan_scoring(LENGTHS, 2, 160)
    assert sorted(i for share in shares for mb in share for i in mb) == list(range(50))
    assert len(shares[0]) == len(shares[1])


def test_a_rank_reads_and_tokenizes_only_its_own_rows(tmp_path):
    """The plan holds lengths and row ids only; a rank reads its rows by id (here every other line: blank lines
    between rows) and tokenizes them in one call."""
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n\n" for n, _ in LENGTHS))
    data = Prepared(rows=np.arange(50) * 2, lengths=np.array([[n] for n, _ in LENGTHS], dtype=np.int32),
                    labels=np.array([[n - 1] for n, _ in LENGTHS], dtype=np.int32), summary="", prompt_tails=0,
                    fingerprint="f")
    cfg = SimpleNamespace(packing_samples=True, use_dynamic_batch=True, max_tokens_per_gpu=64, train_batch_size=8,
                          max_epochs=1, max_steps=None, seed=1, micro_train_batch_size=1)
    plans = plan_ranks(data, [str(path)], cfg, world_size=2)
    seen = []

    def tokenize(subset):
        seen.append(subset.sources)
        return [SimpleNamespace(tokens=[0] * len(r["text"])) for r in subset.rows]

    mine = own_items(plans[1], tokenize)
    assert [len(s) for s in seen] == [len(mine)] and sorted(mine) == plans[1].sample_ids()  # one call, own rows
    assert seen[0] == [f"{path}:{2 * i + 1}" for i in plans[1].sample_ids()]
    assert all(len(mine[i].tokens) == LENGTHS[i][0] for i in mine)
    assert set(plans[0].sample_ids()).isdisjoint(plans[1].sample_ids())
    assert len(plans[0].sample_ids()) + len(plans[1].sample_ids()) == 48  # 6 full steps of 8 out of 50
