"""--ring_attn_size N plans world / N data-parallel row groups of rows up to N x --max_tokens_per_gpu, and every rank
of a context group gets the same micro-batches (``trainers/run.plan_ranks``)."""

from types import SimpleNamespace

import numpy as np

from openpack.trainers.run import plan_ranks


def _train_cfg(**overrides):
    fields = dict(packing_samples=True, use_dynamic_batch=True, max_tokens_per_gpu=100, micro_train_batch_size=1,
                  train_batch_size=12, max_epochs=1, max_steps=None, seed=3, ring_attn_size=2)
    return SimpleNamespace(**{**fields, **overrides})


def _prepared(lengths):
    """The driver's numbers for one-segment samples (``data.prepared.Prepared``'s fields plan_ranks reads)."""
    lengths = np.array(lengths, dtype=np.int32)[:, None]
    return SimpleNamespace(rows=np.arange(len(lengths)), lengths=lengths, labels=lengths.copy(), fingerprint="data")


def test_context_groups_share_their_micro_batches():
    data = _prepared([30 + 7 * i for i in range(24)])
    plans = plan_ranks(data, ["data"], _train_cfg(), world_size=4)
    steps = [[step.micro_batches for step in plan.steps] for plan in plans]
    assert steps[0] == steps[1] and steps[2] == steps[3] and steps[0] != steps[2]
    data_parallel = plan_ranks(data, ["data"], _train_cfg(ring_attn_size=1, max_tokens_per_gpu=200), world_size=2)
    assert steps[::2] == [[step.micro_batches for step in plan.steps] for plan in data_parallel]
    assert all(step.max_tokens == 200 for step in plans[0].steps)
