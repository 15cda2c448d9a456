"""Learning-rate factors: linear warmup, then cosine / linear decay to min_lr_ratio, or constant."""

import math

import pytest

from openpack.distributed.engine import OptimConfig, lr_lambda


def factors(schedule, warmup=2, total=10, min_ratio=0.1):
    f = lr_lambda(OptimConfig(1.0, 0.0, (0.9, 0.95), schedule, warmup, total, min_ratio, 1.0))
    return [f(step) for step in range(total + 1)]


def test_warmup_rises_linearly_to_the_peak():
    assert factors("cosine")[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_cosine_ends_at_min_ratio_and_passes_the_midpoint():
    f = factors("cosine")
    assert f[-1] == pytest.approx(0.1)
    assert f[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway through the decay


def test_linear_and_constant():
    assert factors("linear")[6] == pytest.approx(0.1 + 0.9 * 0.5)
    assert factors("constant")[2:] == [1.0] * 9
