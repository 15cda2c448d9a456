"""Run episodes concurrently: each alternates engine turns and environment steps until done or a limit.

Episodes are asyncio tasks under a concurrency limit, so one episode's slow environment never holds up another's
next turn. A turn asks ``policy(ids, max_tokens, turn)`` (an async callable returning the engine's ``Completion``;
``turn`` counts from 0) for the episode's whole context as ids; the sampled ids and log-probs are kept as sampled
(``Episode.add_action``).

Limits: ``max_turns`` actions; ``max_tokens`` for the whole episode (first observation included), each turn's
generation capped to what is left and an observation that would pass it ending the episode (counted as
"token_budget"); ``env_timeout_s`` for each ``reset`` and ``step``. An environment that raises, times out or
returns the wrong type ends its episode with ``stop`` "error: ..." or "timeout: ...": counted, logged, left out
of the update. ``check_failures`` stops the run with one line when more than a set fraction failed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from openpack.rl.agents.chat import first_ids, observation_ids
from openpack.rl.agents.episode import Episode


@dataclass
class Limits:
    max_turns: int = 8
    max_tokens: int = 2048  # the whole episode, first observation included
    max_new_tokens: int = 256  # one turn's generation
    env_timeout_s: float = 60.0  # each reset and step

    def __post_init__(self):
        if self.max_turns < 1 or self.max_tokens < 2 or self.max_new_tokens < 1 or self.env_timeout_s <= 0:
            raise ValueError(f"episode limits must be positive: {self}")


class EnvFailureError(RuntimeError):
    """More episodes than allowed ended with an environment error or timeout."""


async def run_episode(make_env, sample: dict, policy, tokenizer, limits: Limits,
                      tools: list[dict] | None = None) -> Episode:
    """One episode of a fresh environment from ``make_env()`` on the dataset row ``sample`` (``tools``: JSON
    schemas the chat template shows with chat-message observations)."""
    env = make_env()
    try:
        first = await asyncio.wait_for(env.reset(sample), limits.env_timeout_s)
        episode = Episode(first_ids(tokenizer, first, tools))
    except asyncio.TimeoutError:
        return Episode([], stop=f"timeout: reset took over {limits.env_timeout_s:g} s")
    except Exception as err:  # noqa: BLE001 - the environment's failure is the episode's outcome
        return Episode([], stop=f"error: reset: {type(err).__name__}: {err}")
    if episode.length >= limits.max_tokens:
        episode.stop = "token_budget"
        return episode
    while True:
        budget = min(limits.max_new_tokens, limits.max_tokens - episode.length)
        completion = await policy(episode.prompt + episode.tokens, budget, episode.turns)
        episode.add_action(list(completion.tokens), list(completion.logprobs), completion.versions)
        action = tokenizer.decode(completion.tokens, skip_special_tokens=True)
        try:
            result = await asyncio.wait_for(env.step(action), limits.env_timeout_s)
        except asyncio.TimeoutError:
            episode.stop = f"timeout: step {episode.turns} took over {limits.env_timeout_s:g} s"
            return episode
        except Exception as err:  # noqa: BLE001
            episode.stop = f"error: step {episode.turns}: {type(err).__name__}: {err}"
            return episode
        episode.credit(result.reward)
        episode.metrics = dict(result.metrics)
        if result.done:
            episode.finished, episode.stop = True, "done"
            return episode
        if episode.turns >= limits.max_turns:
            episode.stop = "max_turns"
            return episode
        ids = observation_ids(tokenizer, result.observation, completion.tokens, tools) if result.observation else []
        if episode.length + len(ids) >= limits.max_tokens:
            episode.stop = "token_budget"
            return episode
        episode.add_observation(ids)


async def run_episodes(make_env, samples: list[dict], policy, tokenizer, limits: Limits,
                       concurrency: int = 64, tools: list[dict] | None = None) -> list[Episode]:
    """Every sample's episode, in order; at most ``concurrency`` under way at once. ``policy``: one turn function
    for all, or a list of one per sample."""
    gate = asyncio.Semaphore(concurrency)
    policies = policy if isinstance(policy, list) else [policy] * len(samples)

    async def one(sample, turn):
        async with gate:
            return await run_episode(make_env, sample, turn, tokenizer, limits, tools)

    return list(await asyncio.gather(*(one(s, p) for s, p in zip(samples, policies))))


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """turns/mean, episode_tokens/mean, the masked (context) fraction, and counts of each way episodes ended."""
    ran = [e for e in episodes if not e.failed]
    tokens = sum(len(e.tokens) for e in ran)
    stops = Counter(e.stop.split(":")[0] for e in episodes)
    metrics = {f"episodes/{stop}": float(count) for stop, count in stops.items()}
    if ran:
        metrics["turns/mean"] = sum(e.turns for e in ran) / len(ran)
        metrics["episode_tokens/mean"] = sum(e.length for e in ran) / len(ran)
        metrics["episode_tokens/masked_fraction"] = 1 - sum(e.sampled_tokens for e in ran) / max(tokens, 1)
    return metrics


def check_failures(episodes: list[Episode], max_fraction: float, flag: str = "--max_env_failure_fraction") -> None:
    """Stop with one line when more than ``max_fraction`` of the episodes failed (naming the first failure)."""
    failed = [e for e in episodes if e.failed]
    if episodes and len(failed) / len(episodes) > max_fraction:
        raise EnvFailureError(f"{len(failed)} of {len(episodes)} episodes ended with an environment error or timeout "
                              f"(more than {flag} {max_fraction:g}); the first: {failed[0].stop}")
