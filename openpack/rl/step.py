"""One step of online RL on packed experience (``rl_step``), one rollout batch from prompts to synced weights:

::

    who                                            what                                           where
    rank 0 (vLLM) or every rank (HF, its share)    prompts -> n completions each, behaviour       generation.py
                                                   log-probs (ahead of training: --async_train)   pipeline.py
    rank 0, then shared                            rewards, shaped (overlong penalty, clipping)   rewards.py
    every rank (the same)                          --dynamic_filtering: groups that teach nothing  here
                                                   dropped, others generated in their place
    every rank, its share of one packed pass       old/reference/critic log-probs, gathered;      experience.py
                                                   advantages (core, the same on every rank)
    every rank                                     optimizer steps on planned packs, the policy   update.py
                                                   (and the critic) loss weighed per token
    rank 0 sends (every rank iterates, ZeRO-3)     weight sync to the engines, version += 1       rollout/weight_sync.py

Every rank holds the whole rollout batch (``episodes.py``); only the forwards are split. A step is one planned
step of the shared ``TrainingRun`` (``trainers/run.py``): checkpoints, ``--max_steps`` and metrics count rollout
batches.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, replace

import torch

from openpack.core.schedule import RankStep
from openpack.data.prompts import Prompt
from openpack.rl.colocation import Colocation
from openpack.rl.episodes import Rollouts, rollout_metrics
from openpack.rl.pipeline import RolloutPipeline
from openpack.rl.rewards import RewardError, shaped_rewards, shared_rewards
from openpack.rl.settings import RLSettings
from openpack.rl.update import train_on
from openpack.trainers.run import TrainingRun

FILTER_ROUNDS = 4  # --dynamic_filtering: rounds of replacement groups per rollout batch at most


@dataclass
class RLLoop:
    """Everything one rollout step uses, built once by ``run_ppo``."""

    run: TrainingRun
    pipeline: RolloutPipeline  # rollout batches, generated up to --max_staleness ahead with --async_train
    sync: object  # weight sync to the engines; None with HF rollouts
    reward: object  # the checked reward source (called on rank 0)
    scorers: dict  # name -> engine scoring completions per token: old, ref, values
    settings: RLSettings
    prompts: list[Prompt]
    schedule: list[list[int]]
    model_cfg: object
    train_cfg: object
    tokenizer: object
    dist: object
    critic: object = None
    kl_ctl: object = None
    colocation: Colocation | None = None  # --colocate_all_models: engines wake, get weights, generate, sleep
    empty_steps: EmptySteps | None = None  # --dynamic_filtering: rollout batches in a row that kept no group


@dataclass
class EmptySteps:
    """How many rollout batches in a row dynamic filtering left with no group to learn from (checkpointed)."""

    in_a_row: int = 0


def rl_step(loop: RLLoop, planned: RankStep) -> dict:
    """Rollout batch ``planned.index``: generate, reward, (filter), train, push; returns the step's metrics."""
    run, settings, dist, tokenizer = loop.run, loop.settings, loop.dist, loop.tokenizer
    start = time.perf_counter()
    step = planned.index
    batch_prompts = [loop.prompts[i] for i in loop.schedule[step]]
    run.engine.eval()
    with _gathered(run.engine, loop.model_cfg.zero_stage, loop.pipeline.generator.backend == "hf"), \
            loop.colocation or contextlib.nullcontext():
        rollouts = loop.pipeline.rollouts(step, dist, version=step)  # version: weight syncs so far
    generation_s = time.perf_counter() - start
    episode_metrics = dict(getattr(loop.pipeline.generator, "metrics", {}))  # multi-turn episodes (rl/agents)
    if not rollouts.prompt_tokens:  # every group of episodes had a failed one: nothing to learn from
        if dist.is_main:
            run.tracker.message(f"rollout batch {step + 1}: no update, every group had a failed episode")
        return {**episode_metrics, "optimizer_steps": 0, "lr": run.engine.get_lr()[0],
                "time/generation": generation_s, "step_time_s": time.perf_counter() - start}
    reward_start = time.perf_counter()
    reward_metrics = _reward(loop, batch_prompts, rollouts, f"rollout batch {step + 1}")
    if settings.dynamic_filtering:
        rollouts, filter_metrics = _dynamically_filtered(loop, step, batch_prompts, rollouts)
        reward_metrics.update(filter_metrics)
        if not _kept_any(loop, step, filter_metrics):  # every advantage would be 0: no update, no weight sync
            return {**rollout_metrics(rollouts, generation_s), **reward_metrics, "optimizer_steps": 0,
                    "time/reward": time.perf_counter() - reward_start, "lr": run.engine.get_lr()[0],
                    "step_time_s": time.perf_counter() - start}
    reward_s = time.perf_counter() - reward_start
    step_settings = replace(settings, kl_coef=loop.kl_ctl.value) if settings.reward_kl else settings
    metrics, timings = train_on(rollouts, run.engine, loop.scorers, step_settings, loop.train_cfg, dist,
                                tokenizer.pad_token_id or 0, loop.train_cfg.seed + step, loop.critic,
                                train_actor=step >= settings.freezing_actor_steps)
    if settings.reward_kl:
        metrics["kl_coef"] = step_settings.kl_coef
        loop.kl_ctl.update(metrics["kl"], len(rollouts.rewards))
    sync_s = loop.colocation.push_s if loop.colocation else \
        push_weights(loop.sync, run.engine, loop.model_cfg.zero_stage, dist) if loop.sync is not None else 0.0
    return {**rollout_metrics(rollouts, generation_s), **episode_metrics, **loop.pipeline.metrics, **reward_metrics,
            **metrics, **timings, **_sync_metrics(loop.sync), "time/reward": reward_s, "time/weight_sync": sync_s,
            "lr": run.engine.get_lr()[0], "step_time_s": time.perf_counter() - start}


def push_weights(sync, engine, zero_stage: int, dist) -> float:
    from openpack.rollout.weight_sync import policy_weights

    start = time.perf_counter()
    sync.push(policy_weights(engine.module, zero_stage), dist.is_main)
    return time.perf_counter() - start


def _sync_metrics(sync) -> dict:
    """What the last push put into Ray's object store (inhost sync to engines that are Ray actors)."""
    pushed = getattr(sync, "object_store_bytes", None)
    return {} if pushed is None else {"weight_sync/object_store_mb": pushed / 2**20}


def _reward(loop: RLLoop, prompts: list[Prompt], rollouts: Rollouts, where: str) -> dict:
    """Set ``rollouts.rewards`` (``prompts``: one per group of n completions): the source's, asked on rank 0 and
    shared, then shaped (overlong penalty, clipping); returns the reward metrics."""
    if rollouts.env_rewards:  # episodes: the environment's rewards, summed over each episode's turns
        rollouts.rewards, metrics = shaped_rewards(rollouts.env_rewards, rollouts.response_lengths(), loop.settings)
        return metrics
    n = loop.settings.n_samples_per_prompt
    texts = ([p.text for p in prompts for _ in range(n)],
             loop.tokenizer.batch_decode(rollouts.completion_tokens, skip_special_tokens=True),
             [p.row for p in prompts for _ in range(n)])
    sequences = [p + c for p, c in zip(rollouts.prompt_tokens, rollouts.completion_tokens)]
    raw = shared_rewards(loop.reward, texts, loop.dist, where, sequences)
    rollouts.rewards, metrics = shaped_rewards(raw, rollouts.response_lengths(), loop.settings)
    return metrics


def _dynamically_filtered(loop: RLLoop, step: int, prompts: list[Prompt], rollouts: Rollouts) -> tuple[Rollouts, dict]:
    """DAPO's dynamic sampling: groups whose rewards are all equal (or whose mean is outside
    --dynamic_filtering_reward_range) teach nothing and are dropped; groups of other prompts, drawn by a seed of
    the run, the step and the round (so a resumed run draws the same), are generated and scored in their place,
    for at most ``FILTER_ROUNDS`` rounds. A batch still short is filled with dropped groups (counted)."""
    from openpack.core.advantages import keep_groups

    n, wanted, settings = loop.settings.n_samples_per_prompt, len(prompts), loop.settings
    kept, spare, dropped, rounds = [], [], 0, 0
    while True:
        keep = keep_groups(torch.tensor(rollouts.rewards), n, settings.dynamic_filtering_reward_range).tolist()
        dropped += keep.count(False)
        for g, good in enumerate(keep):
            (kept if good else spare).append(rollouts.select(range(g * n, (g + 1) * n)))
        if len(kept) >= wanted or rounds == FILTER_ROUNDS:
            break
        rounds += 1
        draw = random.Random(f"{loop.train_cfg.seed}/{step}/refill{rounds}")
        prompts = [loop.prompts[i] for i in draw.sample(range(len(loop.prompts)), min(wanted - len(kept),
                                                                                      len(loop.prompts)))]
        with _gathered(loop.run.engine, loop.model_cfg.zero_stage, loop.pipeline.generator.backend == "hf"), \
                loop.colocation or contextlib.nullcontext():
            rollouts = loop.pipeline.generator.rollouts(prompts, f"{step}.refill{rounds}", loop.dist, version=step)
        _reward(loop, prompts, rollouts, f"rollout batch {step + 1}, refill {rounds}")
    short = max(wanted - len(kept), 0)
    groups = kept[:wanted] + spare[:short]
    metrics = {"dynamic_filtering/kept_groups": float(min(len(kept), wanted)),
               "dynamic_filtering/dropped_groups": float(dropped), "dynamic_filtering/refill_rounds": float(rounds),
               "dynamic_filtering/short_groups": float(short)}
    return Rollouts.concat(groups), metrics


def _kept_any(loop: RLLoop, step: int, metrics: dict) -> bool:
    """Say on the console what dynamic filtering kept; False when it kept no group (the step's update is skipped),
    and a RewardError after --dynamic_filtering_max_empty_steps such rollout batches in a row."""
    kept, wanted = int(metrics["dynamic_filtering/kept_groups"]), len(loop.schedule[step])
    limit, empty = loop.settings.dynamic_filtering_max_empty_steps, loop.empty_steps
    empty.in_a_row = 0 if kept else empty.in_a_row + 1
    line = (f"rollout batch {step + 1}: dynamic filtering kept {kept} of {wanted} groups "
            f"({int(metrics['dynamic_filtering/dropped_groups'])} dropped over "
            f"{int(metrics['dynamic_filtering/refill_rounds'])} refill rounds)")
    if not kept:
        line += f"; no update: every group was dropped ({empty.in_a_row} of {limit} such batches in a row)"
    if loop.dist.is_main:
        loop.run.tracker.message(line)
    if empty.in_a_row >= limit:
        name, bounds = getattr(loop.reward, "reward_name", "the reward"), _typed_range(loop.settings)
        outside = f" (or means outside --dynamic_filtering_reward_range {bounds})" if bounds else ""
        raise RewardError(f"--dynamic_filtering: {limit} rollout batches in a row kept no group "
                          f"(--dynamic_filtering_max_empty_steps {limit}): {name} gives equal rewards to every "
                          f"completion of a prompt{outside}, so nothing can be learned; check the reward"
                          f"{' and --dynamic_filtering_reward_range' if bounds else ''}, or drop --dynamic_filtering")
    return kept > 0


def _typed_range(settings: RLSettings) -> str:
    """--dynamic_filtering_reward_range as typed, or '' when none was given."""
    bounds = settings.dynamic_filtering_reward_range
    return f"{bounds[0]:g} {bounds[1]:g}" if bounds else ""


def _gathered(engine, zero_stage: int, needed: bool):
    """HF generation under ZeRO-3 needs the whole policy on every rank while it generates."""
    import contextlib

    if not needed or zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
