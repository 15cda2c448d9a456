"""How far ahead of training rollout batches are generated: ``RolloutPipeline`` hands ``rl_step`` batch k and,
with ``--async_train``, keeps up to ``--max_staleness`` N later batches in flight meanwhile:

::

    sync (N = 0)     gen 0 | train 0 | sync | gen 1 | train 1 | sync | gen 2 ...
    async (N = 1)    gen 0 | train 0           | sync | train 1           | sync | train 2 ...
                           | gen 1 (version 0) |      | gen 2 (version 1) |

The trade-off (PipelineRL, AReaL): generation stops waiting for training, and a rollout trained at version v was
sampled by version v - N (the ratio's denominator then comes from a scoring pass of the current policy, and the
vLLM log-probs feed the TIS correction as before). Ordering is what makes the versions exact: a Ray actor runs
its calls in order, so a weight update queued after a generation waits for it; in-process engines get the same
rule from one worker thread (``generation.InOrder``). A multi-turn episode's turn asked for after an update was
queued samples with the new weights; the episode keeps the version it was asked with, its oldest (so staleness is
never understated), and its behaviour log-probs are each turn's own sampler's.

Partial rollouts (``--partial_rollout``; OpenRLHF's ``--train.partial_rollout_enable``, NeMo-RL's in-flight weight
updates): the update does not wait. The engines pause between two sampling steps, keeping the completions under
way, take the new weights and resume (``landing``), so a completion may hold tokens of two or more versions::

    partial (N = 1)  gen 0 | train 0              | sync | train 1 ...
                           | gen 1: v0 tokens ... | v1 tokens ... (continued, not thrown away)

Each token keeps the version that sampled it and its behaviour log-prob under that version's weights
(``Rollouts.token_versions``), so the rollout corrections weigh every token by its own sampler; a sample's
``versions`` entry (staleness, the ``--max_staleness`` bound) is its first token's, the oldest.
"""

from __future__ import annotations

import contextlib
import logging
import time

from openpack.data.prompts import Prompt
from openpack.rl.episodes import Rollouts
from openpack.rl.generation import Generator, Pending

logger = logging.getLogger("openpack")


def drop_stale(rollouts: Rollouts, version: int, max_staleness: int) -> tuple[Rollouts, int]:
    """The samples of ``rollouts`` at most ``max_staleness`` versions older than ``version``, and how many were
    older (the bound PPO's clipped ratio is trusted to; PipelineRL and AReaL drop past it too)."""
    keep = [k for k, v in enumerate(rollouts.versions) if version - v <= max_staleness]
    if len(keep) == len(rollouts.versions):
        return rollouts, 0
    return rollouts.select(keep), len(rollouts.versions) - len(keep)


class RolloutPipeline:
    """Rollout batch k for ``rl_step``, with up to ``depth`` later batches in flight (``--max_staleness`` under
    ``--async_train``; 0: generated when asked for, the synchronous loop).

    Batches ahead are asked for with the weights of the version that asks, before this step's update, so batch
    k + j is sampled by version k and trained at version k + j. Only rank 0 talks to vLLM engines; the others
    take part in each batch's broadcast, in step order. A new pipeline starts empty: a resumed run at step s
    generates batch s with the resumed weights, so no batch is lost or trained twice. A batch found staler than
    ``max_staleness`` when trained (the depth never allows it; the guard holds the bound) is dropped, counted,
    and generated again with the current weights and the same seeds.
    """

    def __init__(self, generator: Generator, prompts: list[Prompt], schedule: list[list[int]], depth: int,
                 async_train: bool, partial: bool = False):
        self.generator, self.prompts, self.schedule = generator, prompts, schedule
        self.depth, self.async_train, self.partial = depth, async_train, partial
        self.in_flight: dict[int, Pending] = {}
        self.async_metrics: dict[str, float] = {}

    def rollouts(self, step: int, dist, version: int) -> Rollouts:
        """Rollout batch ``step`` trained at policy ``version``; then the batches up to ``step + depth`` asked for."""
        start = time.perf_counter()
        pending = self.in_flight.pop(step, None) or self._submit(step, dist, version)
        for ahead in range(step + 1, min(step + self.depth, len(self.schedule) - 1) + 1):
            if ahead not in self.in_flight:
                self.in_flight[ahead] = self._submit(ahead, dist, version)
        rollouts, dropped = drop_stale(self.generator.result(pending, dist), version, self.depth)
        if dropped:
            logger.warning("rollout batch %d: %d samples older than --max_staleness %d versions dropped; generating "
                           "it again with the current weights", step + 1, dropped, self.depth)
            rollouts = self.generator.result(self._submit(step, dist, version), dist)
        if self.async_train:
            self.async_metrics = {"async/staleness": sum(version - v for v in rollouts.versions) / len(rollouts.versions),
                            "async/dropped_stale": float(dropped),
                            "async/generation_wait_s": time.perf_counter() - start}
        return rollouts

    @contextlib.contextmanager
    def landing(self, version: int, dist):
        """Around a weight push that makes the engines' weights policy ``version``: with --partial_rollout, rank 0
        pauses the generations under way between two sampling steps before it and resumes them with the new weights
        (labelled ``version``) after; otherwise nothing (an update queued after a generation waits for it)."""
        engines = self.generator.engines if self.partial and dist.is_main else None
        if engines is not None:
            engines.pause_generation()
        yield
        if engines is not None:
            engines.resume_generation(version)

    def metrics(self) -> dict[str, float]:
        """The last batch's: its generator's (episodes, tools) and, with --async_train, its staleness and wait."""
        return {**self.generator.metrics(), **self.async_metrics}

    def _submit(self, step: int, dist, version: int) -> Pending:
        return self.generator.submit([self.prompts[i] for i in self.schedule[step]], step, dist, version)
