"""Rollout batches of multi-turn episodes: ``AgentGenerator`` stands in for ``rl.generation.Generator`` under
``--env_file``/``--agent_func_path``/``--tools``, and the rest of the step (rewards, experience, updates) trains
on its ``Rollouts`` as on single-turn ones.

Who runs the episodes: with vLLM, rank 0 runs every episode against the engines, in a thread of its own (so
``--async_train`` overlaps them with training) and hands them to the other ranks; with HF generation each rank
runs the episodes of its share of the prompts with its own policy and the ranks gather them. Each turn's request
is seeded from the run's seed, the rollout step, the episode and the turn (``request_seed``), so a resumed run,
and 1 rank or 2, sample the same episodes from deterministic environments.

Turns go to the engines as they come (``EnginePolicy``): every request waiting when the engines are free goes in
one call, so turn 3 of one episode shares a call with turn 1 of another and no episode waits for another's
environment. HF generation takes one request a call (its samples depend on the batch, so one a call keeps them
per request).

Episodes that failed (the environment raised, timed out or answered the wrong type) are counted, logged and left
out of the update together with their group (a group's baseline needs all of its n episodes); past
``--max_env_failure_fraction`` of a batch the run stops with one line (``runner.check_failures``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections import Counter
from dataclasses import dataclass, replace

from openpack.distributed.process import all_gather_objects, broadcast_object
from openpack.rl.agents.episode import Episode
from openpack.rl.agents.runner import Limits, check_failures, episode_metrics, run_episodes
from openpack.rl.episodes import Rollouts, sampling_versions
from openpack.rl.generation import Pending, _share, request_seed
from openpack.rollout.interface import Completion, SamplingConfig

logger = logging.getLogger("openpack")


class EnginePolicy:
    """The runner's turn function over an engine: ``await policy(ids, max_tokens, seed)`` -> ``Completion``.

    ``batched``: requests that wait while a call runs go together in the next call (vLLM); else one request a
    call (HF). Calls run in a worker thread, so environments keep stepping meanwhile."""

    def __init__(self, generate, sampling: SamplingConfig, batched: bool):
        self.generate, self.sampling, self.batched = generate, sampling, batched
        self.queue: list = []
        self.drain: asyncio.Task | None = None
        self.calls = 0

    async def __call__(self, ids: list[int], max_tokens: int, seed: int) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self.queue.append((list(ids), max_tokens, seed, future))
        if self.drain is None or self.drain.done():
            self.drain = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self.queue:
            await asyncio.sleep(0)  # episodes that are ready queue their turns first
            take = len(self.queue) if self.batched else 1
            batch, self.queue = self.queue[:take], self.queue[take:]
            try:
                results = await asyncio.to_thread(self._generate, batch)
            except Exception as err:  # noqa: BLE001 - an engine failure is the run's, raised in each waiting turn
                for *_, future in batch:
                    future.set_exception(err)
                continue
            for (*_, future), completion in zip(batch, results):
                future.set_result(completion)

    def _generate(self, batch: list) -> list[Completion]:
        """One engine call per distinct turn budget (vLLM takes one max_tokens a call), results in batch order."""
        results: list = [None] * len(batch)
        for budget in sorted({b for _, b, _, _ in batch}):
            picked = [i for i, (_, b, _, _) in enumerate(batch) if b == budget]
            sampling = replace(self.sampling, n=1, max_tokens=budget)
            outputs = self.generate([batch[i][0] for i in picked], sampling, [batch[i][2] for i in picked])
            self.calls += 1
            for i, output in zip(picked, outputs):
                results[i] = output[0]
        return results


@dataclass
class AgentPending(Pending):
    """A rollout batch of episodes asked for: the thread running them (vLLM) or their share (HF)."""

    thread: threading.Thread | None = None
    episodes: list | None = None
    error: BaseException | None = None


class AgentGenerator:
    """Rollout batches of episodes (``submit``/``result``/``rollouts``, as ``Generator``)."""

    def __init__(self, generator, make_env, rows_of, tokenizer, limits: Limits, concurrency: int,
                 max_failure_fraction: float, tools: list[dict] | None = None):
        self.generator = generator  # the single-turn Generator: its engines, sampling and seed
        self.make_env, self.rows_of, self.tokenizer = make_env, rows_of, tokenizer
        self.limits, self.concurrency, self.tools = limits, concurrency, tools
        self.max_failure_fraction = max_failure_fraction
        self.last_metrics: dict[str, float] = {}

    @property
    def backend(self) -> str:
        return self.generator.backend

    @property
    def engines(self):
        return self.generator.engines

    def submit(self, prompts, step, dist, version: int) -> AgentPending:
        n = self.generator.sampling.n
        samples = [self.rows_of(p) for p in prompts for _ in range(n)]
        pending = AgentPending(step, version, [p.tokens for p in prompts])
        if self.backend == "hf":
            lo, hi = _share(len(prompts), dist.rank, dist.world_size)
            pending.parts.append((lo * n, hi * n, samples[lo * n:hi * n]))
        elif dist.is_main:
            pending.parts.append((0, len(samples), samples))
            pending.thread = threading.Thread(target=self._run_into, args=(pending,), daemon=True,
                                              name=f"openpack-episodes-{step}")
            pending.thread.start()
        return pending

    def episodes(self, pending: AgentPending, dist) -> list[Episode]:
        """Every episode of a submitted batch, failed ones included, in sample order on every rank (a collective)."""
        if self.backend == "hf":
            self._run_into(pending)
        elif pending.thread is not None:
            pending.thread.join()
        if pending.error is not None:
            raise pending.error
        local = pending.episodes or []
        if self.backend == "hf":
            return [e for part in all_gather_objects(local) for e in part]
        return broadcast_object(local)

    def result(self, pending: AgentPending, dist) -> Rollouts:
        episodes = self.episodes(pending, dist)
        check_failures(episodes, self.max_failure_fraction)
        rollouts, dropped = episode_rollouts(episodes, self.generator.sampling.n, pending.version)
        self.last_metrics = {**episode_metrics(episodes), **environment_metrics(episodes),
                        "episodes/dropped_groups": float(dropped)}
        failures = Counter(e.stop for e in episodes if e.failed)
        if failures and dist.is_main:
            logger.warning("rollout batch %s: %d episode(s) failed and were left out with their groups: %s",
                           pending.step + 1 if isinstance(pending.step, int) else pending.step, sum(failures.values()),
                           "; ".join(f"{n} x {why}" for why, n in failures.most_common(3)))
        return rollouts

    def rollouts(self, prompts, step, dist, version: int = 0) -> Rollouts:
        return self.result(self.submit(prompts, step, dist, version), dist)

    def metrics(self) -> dict[str, float]:
        """The last batch's episode, environment and tool numbers."""
        return self.last_metrics

    def with_sampling(self, sampling: SamplingConfig) -> AgentGenerator:
        """Episodes of the same environments and engines, each turn sampled otherwise (the held-out evaluation)."""
        other = copy.copy(self)
        other.generator = self.generator.with_sampling(sampling)
        return other

    def _run_into(self, pending: AgentPending) -> None:
        """Run this rank's episodes of ``pending`` (in this thread, with its own event loop); errors kept."""
        try:
            pending.episodes = [e for lo, _, samples in pending.parts
                                for e in asyncio.run(self._episodes(pending.step, lo, samples))]
        except BaseException as err:  # noqa: BLE001 - re-raised by result() in the caller's thread
            pending.error = err

    async def _episodes(self, step, first: int, samples: list[dict]) -> list[Episode]:
        engines = self.generator.engines
        generate = engines.generate if self.backend == "hf" else \
            (lambda prompts, sampling, seeds: engines.start_generate(prompts, sampling, seeds)())
        policy = EnginePolicy(generate, self.generator.sampling, batched=self.backend != "hf")
        seed = self.generator.seed

        def turns_of(index: int):
            async def turn(ids, max_tokens, turn_index):
                return await policy(ids, max_tokens, request_seed(seed, step, f"{index}/{turn_index}"))
            return turn

        return await run_episodes(self.make_env, samples, [turns_of(first + i) for i in range(len(samples))],
                                  self.tokenizer, self.limits, self.concurrency, self.tools)


def episode_rollouts(episodes: list[Episode], n: int, version: int) -> tuple[Rollouts, int]:
    """Episodes as ``Rollouts`` (targets only in the per-token lists), leaving out every group of ``n`` with a
    failed episode; also how many groups that left out."""
    rollouts = Rollouts([], [], [], [])
    dropped = 0
    for g in range(0, len(episodes), n):
        group = episodes[g:g + n]
        if any(e.failed for e in group):
            dropped += 1
            continue
        for e in group:
            rollouts.prompt_tokens.append(list(e.prompt))
            rollouts.completion_tokens.append(list(e.tokens))
            rollouts.targets.append(list(e.targets))
            rollouts.behaviour.append([b for b, t in zip(e.behaviour, e.targets) if t])
            rollouts.finished.append(e.finished)
            rollouts.versions.append(version)
            rollouts.token_versions.append(sampling_versions([v for v, t in zip(e.versions, e.targets) if t],
                                                             e.sampled_tokens, version))
            rollouts.env_rewards.append(e.reward)
            rollouts.turn_credit.append([r for r, t in zip(e.token_rewards(), e.targets) if t])
    return rollouts, dropped


def environment_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The built-in tool loop's counts over the batch (its environments report them per episode), and the mean of
    every other metric the environments report (``env/<name>``)."""
    ran = [e for e in episodes if not e.failed]
    names = sorted({k for e in ran for k in e.metrics})
    metrics = {}
    for name in names:
        values = [e.metrics[name] for e in ran if name in e.metrics]
        if name in ("tool_calls", "tool_failures"):
            metrics[f"tools/{name.split('_')[1]}"] = float(sum(values))
        else:
            metrics[f"env/{name}"] = sum(values) / len(values)
    return metrics
