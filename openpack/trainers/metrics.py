"""Step metrics that stay on the device until a step is logged: no host sync per micro-batch (issue 16).

Reading a CUDA tensor on the host (``.item()``, ``.tolist()``, ``float(t)``)
waits for every kernel queued before it, so the host cannot queue the next
micro-batch while the GPU works; DPO read 7 numbers per micro-batch that way.
A step now adds its statistics into one fp64 tensor of sums on the device
(``DeviceSums.add``, no sync) and returns ``StepMetrics``, a mapping that
reads itself when first looked into: ``run_steps`` does so only for the
steps it logs (every ``--logging_steps``, and the last), on every rank (the
all-reduce is collective): one all-reduce on the device and one copy to the
host. Steps that are not logged are never read.

fp64 sums of fp32 values round exactly as the Python floats they replace
did, so the logged numbers are unchanged. Step time and the rates are taken
after the copy: without a sync inside the step, the host's clock at the
step's end would only say how fast it queued the kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class DeviceSums:
    """Named numbers summed over a step's micro-batches on ``device``: ``total`` [len(names)] fp64."""

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names = tuple(names)
        self.total = torch.zeros(len(self.names), dtype=torch.float64, device=device)

    def add(self, **values: torch.Tensor | float) -> None:
        """One micro-batch's numbers, one for each of ``names`` (0-dim tensors or Python numbers); no host sync."""
        if values.keys() != set(self.names):
            raise ValueError(f"DeviceSums.add: got {sorted(values)}, expected {sorted(self.names)}")
        device = self.total.device
        self.total += torch.stack([
            v.detach().reshape(()).to(device, torch.float64) if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=torch.float64, device=device)  # made on the device: no copy
            for v in (values[name] for name in self.names)])

    def get(self, name: str) -> torch.Tensor:
        """The sum of ``name`` so far: a device scalar, unread (e.g. the step's loss for ``optimizer_step``)."""
        return self.total[self.names.index(name)]


def summed_over_ranks(total: torch.Tensor) -> torch.Tensor:
    """``total`` added over the process group's ranks, on the device (a copy; no host sync with NCCL)."""
    total = total.clone()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    return total


def maximum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` (a device scalar) maximised over the process group's ranks, on the device (no host sync)."""
    value = value.clone()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return value


@dataclass
class StepMetrics(Mapping):
    """One step's metrics, read to the host when first looked into (on every rank together: it all-reduces).

    ``finish(totals)`` turns the sums over every rank (by name) into logged metrics; ``values`` are known
    already (host numbers) or the same on every rank (device scalars such as the grad norm, read with the sums);
    ``rates`` (name -> count, e.g. ``tokens_per_s``: the step's real tokens) are divided by the step's time,
    logged with them as ``step_time_s``.
    """

    sums: DeviceSums
    finish: Callable[[dict[str, float]], dict]
    values: dict = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)
    _read: dict | None = field(default=None, repr=False)

    def read(self) -> dict:
        return read_together([self])[0]

    def update(self, more: dict) -> None:
        """Add host values (e.g. a held-out evaluation's, ``rm_worker``), logged with the rest."""
        self.values.update(more)
        if self._read is not None:
            self._read.update(more)

    def __getitem__(self, key: str):
        return self.read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.read())

    def __len__(self) -> int:
        return len(self.read())


def read_together(metrics: list[StepMetrics]) -> list[dict]:
    """Each one's metrics, read with one all-reduce and one copy to the host for all (every rank together).

    An online-RL rollout batch reads its several optimizer steps (policy and critic) this way, once.
    """
    unread = [m for m in metrics if m._read is None]
    if unread:
        total = summed_over_ranks(torch.cat([m.sums.total for m in unread]))
        scalars = [[k for k, v in m.values.items() if isinstance(v, torch.Tensor)] for m in unread]
        numbers = torch.cat([total, *(m.values[k].detach().reshape(1).to(total.device, torch.float64)
                                      for m, keys in zip(unread, scalars) for k in keys)]).tolist()  # the one sync
        now = time.perf_counter()
        sums, read = iter(numbers[:total.numel()]), iter(numbers[total.numel():])
        for m, keys in zip(unread, scalars):
            own = {name: next(sums) for name in m.sums.names}
            scalar = {k: next(read) for k in keys}
            m._read = {**m.finish(own), **{k: scalar.get(k, v) for k, v in m.values.items()}}
            if m.rates:
                elapsed = now - m.start
                m._read.update({name: count / elapsed for name, count in m.rates.items()}, step_time_s=elapsed)
    return [m._read for m in metrics]


class Phases:
    """The wall-clock time of a step's phases and the metrics they report, gathered for the step's one return.

    ``with phases.time("generation"):`` adds its seconds to ``time/generation``; ``phases.add(metrics)`` adds a
    phase's numbers; ``phases.per_second("generation", generation_tokens_per_s=n)`` logs n over that phase's time;
    ``phases.metrics()`` is all of it, in the order added, with ``step_time_s`` since the step began. Only
    online RL needs it: its step has several phases, where an offline step is one (``StepMetrics.rates``).
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.values: dict[str, float] = {}
        self.rates: list[tuple[str, dict[str, float]]] = []

    @contextmanager
    def time(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{phase}"
            self.values[key] = self.values.get(key, 0.0) + time.perf_counter() - start

    def add(self, metrics: Mapping[str, float]) -> None:
        self.values.update(metrics)

    def per_second(self, phase: str, **counts: float) -> None:
        self.rates.append((phase, counts))

    def metrics(self, **last: float) -> dict[str, float]:
        for phase, counts in self.rates:
            seconds = max(self.values[f"time/{phase}"], 1e-9)
            self.values.update({name: count / seconds for name, count in counts.items()})
        return {**self.values, **last, "step_time_s": time.perf_counter() - self.start}
