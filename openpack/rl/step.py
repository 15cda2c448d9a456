"""One step of online RL on packed experience (``rl_step``), one rollout batch from prompts to synced weights:

::

    phase         who                                          what                                       where
    generate      rank 0 (vLLM) or every rank (HF, its share)  prompts -> n completions each, behaviour   generation.py
                                                               log-probs (ahead of training: async)       pipeline.py
    reward        rank 0, then shared (episodes: their own)    rewards, shaped (overlong penalty, clip)   rewards.py
    filter        every rank (the same)                        --dynamic_filtering: groups that teach      here
                                                               nothing dropped, others generated instead
    experience    every rank, its share of one packed pass     old/reference/critic log-probs, gathered;  experience.py
                                                               advantages (core, the same on every rank)
    update        every rank                                   optimizer steps on planned packs: the      update.py
                                                               critic's, then the policy's loss per token
    push          rank 0 sends (every rank iterates, ZeRO-3)   weight sync to the engines, version += 1   rollout/weight_sync.py

Every rank holds the whole rollout batch (``episodes.py``); only the forwards are split. A step is one planned
step of the shared ``TrainingRun`` (``trainers/run.py``), a ``RolloutBatch``: checkpoints, ``--max_steps`` and
metrics count rollout batches. Each phase reports its numbers to one ``Phases`` object, which times the phases
and makes the step's one return.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from openpack.core.advantages import AdaptiveKLController, FixedKLController
from openpack.data.prompts import Prompt
from openpack.distributed.process import DistInfo
from openpack.rl.colocation import Colocation
from openpack.rl.episodes import Rollouts, rollout_metrics
from openpack.rl.experience import Experience, Scorers, make_experience
from openpack.rl.pipeline import RolloutPipeline
from openpack.rl.rewards import RewardError, RolloutRewards, shaped_rewards
from openpack.rl.settings import RLSettings
from openpack.rl.update import train_on
from openpack.rollout.weight_sync import WeightSync, policy_weights
from openpack.trainers.metrics import Phases
from openpack.trainers.run import TrainingRun

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

FILTER_ROUNDS = 4  # --dynamic_filtering: rounds of replacement groups per rollout batch at most


@dataclass
class RolloutBatch:
    """A planned step of online RL: rollout batch ``index``, its prompts' ids; ``digest`` names them (and the
    seed and n), so a resume with other data or seeds is refused (``trainers/run.py``)."""

    index: int
    prompt_ids: list[int]
    digest: str
    epoch: int = 0  # the run loop's epoch: RL counts rollout batches only


@dataclass
class EmptySteps:
    """How many rollout batches in a row dynamic filtering left with no group to learn from (checkpointed)."""

    in_a_row: int = 0


@dataclass
class RLLoop:
    """Everything one rollout step uses, built once by ``run_ppo``."""

    run: TrainingRun  # the policy's engine, tracker and checkpoints
    pipeline: RolloutPipeline  # rollout batches, generated up to --max_staleness ahead with --async_train
    rewards: RolloutRewards  # a rollout batch's rewards: the reward source's, or the episodes' own
    scorers: Scorers
    settings: RLSettings
    prompts: list[Prompt]
    dist: DistInfo
    pad_token_id: int
    sync: WeightSync | None = None  # weight sync to the engines; None with HF rollouts
    critic: DeepSpeedEngine | None = None
    kl_ctl: AdaptiveKLController | FixedKLController = field(default_factory=lambda: FixedKLController(0.0))
    colocation: Colocation | None = None  # --colocate_all_models: engines wake, get weights, generate, sleep
    empty_steps: EmptySteps = field(default_factory=EmptySteps)  # --dynamic_filtering


def rl_step(loop: RLLoop, batch: RolloutBatch) -> dict:
    """Rollout batch ``batch.index``: generate, reward, filter, make the experience, update, push; returns the step's
    metrics."""
    phases = Phases()
    with phases.time("generation"):
        rollouts = generate(loop, batch, phases)
    with phases.time("reward"):
        reward(loop, [loop.prompts[i] for i in batch.prompt_ids], rollouts, f"rollout batch {batch.index + 1}", phases)
        learnable = filter_groups(loop, batch, rollouts, phases)
    if learnable is not None:
        with phases.time("experience"):
            experience = experience_of(loop, learnable, phases)
        with phases.time("training"):
            update(loop, batch, experience, phases)
        with phases.time("weight_sync"):
            push_weights(loop, phases, version=batch.index + 1)
    return phases.metrics(lr=loop.run.engine.get_lr()[0])


def generate(loop: RLLoop, batch: RolloutBatch, phases: Phases) -> Rollouts:
    """The batch's completions (or episodes) on every rank, sampled by the policy version ``batch.index`` (weight
    syncs so far); colocated engines wake for it (and get the weights) and sleep after."""
    loop.run.engine.eval()
    with gathered(loop), loop.colocation or contextlib.nullcontext():
        rollouts = loop.pipeline.rollouts(batch.index, loop.dist, version=batch.index)
    phases.add(loop.pipeline.metrics())
    phases.per_second("generation", generation_tokens_per_s=sum(rollouts.response_lengths()))
    return rollouts


def reward(loop: RLLoop, prompts: list[Prompt], rollouts: Rollouts, where: str, phases: Phases | None = None) -> None:
    """Set ``rollouts.rewards`` (``prompts``: one per group of n completions): the source's (asked on rank 0 and
    shared) or the episodes' own, then shaped (overlong penalty, clipping); and a reward file's scores and logs."""
    if not rollouts.size:
        return
    answer = loop.rewards(prompts, rollouts, loop.dist, where)
    rollouts.rewards, metrics = shaped_rewards(answer.rewards, rollouts.response_lengths(), rollouts.finished,
                                               loop.settings)
    rollouts.scores, rollouts.reward_logs = answer.scores or [], answer.extra_logs
    if phases is not None:
        phases.add(metrics)


def filter_groups(loop: RLLoop, batch: RolloutBatch, rollouts: Rollouts, phases: Phases) -> Rollouts | None:
    """What the batch teaches: its rollouts, after --dynamic_filtering, with their statistics logged; None (said on
    the console, no update and no weight sync) when nothing is left to learn from."""
    if not rollouts.size:  # every group of episodes had a failed one
        if loop.dist.is_main:
            loop.run.tracker.message(f"rollout batch {batch.index + 1}: no update, every group had a failed episode")
        phases.add({"optimizer_steps": 0})
        return None
    kept = True
    if loop.settings.dynamic_filtering:
        rollouts, metrics = _dynamically_filtered(loop, batch, rollouts)
        phases.add(metrics)
        kept = _kept_any(loop, batch, metrics)
    phases.add(rollout_metrics(rollouts))
    if not kept:  # every advantage would be 0
        phases.add({"optimizer_steps": 0})
    return rollouts if kept else None


def experience_of(loop: RLLoop, rollouts: Rollouts, phases: Phases) -> Experience:
    """The batch scored and its advantages computed (``experience.py``), with the KL coefficient of this batch; an
    adaptive one then moves with the batch's KL."""
    settings = replace(loop.settings, kl_coef=loop.kl_ctl.value) if loop.settings.reward_kl else loop.settings
    experience = make_experience(rollouts, loop.scorers, settings, loop.dist, loop.pad_token_id)
    metrics = experience.metrics(settings.policy.kl_estimator)
    phases.add(metrics)
    if settings.reward_kl:
        phases.add({"kl_coef": settings.kl_coef})
        loop.kl_ctl.update(metrics["kl"], len(rollouts.rewards))
    return experience


def update(loop: RLLoop, batch: RolloutBatch, experience: Experience, phases: Phases) -> None:
    """The critic's and the policy's optimizer steps on the experience (``update.py``); only the critic's for the
    first --freezing_actor_steps batches."""
    metrics, tokens = train_on(experience, loop.run.engine, loop.critic, loop.settings, loop.dist,
                               loop.settings.seed + batch.index,
                               train_actor=batch.index >= loop.settings.freezing_actor_steps, version=batch.index)
    phases.add(metrics)
    phases.per_second("training", tokens_per_s=tokens, training_tokens_per_s=tokens)


def push_weights(loop: RLLoop, phases: Phases, version: int) -> None:
    """The policy's weights to the engines, which then hold policy ``version``; colocated, they were pushed at the
    engines' wake instead, before this batch's generation. HF rollouts sample from the policy itself: nothing to
    push. With --partial_rollout they land in the generations under way (``RolloutPipeline.landing``)."""
    if loop.sync is not None and loop.colocation is None:
        with loop.pipeline.landing(version, loop.dist):
            send_weights(loop.sync, loop.run.engine, loop.dist)
    phases.add({**(loop.sync.metrics() if loop.sync is not None else {}),
                **(loop.colocation.metrics() if loop.colocation is not None else {})})


def send_weights(sync: WeightSync, engine: DeepSpeedEngine, dist: DistInfo) -> float:
    """Push ``engine``'s weights through ``sync`` (a collective: every rank calls it); returns the seconds it took."""
    return sync.push(policy_weights(engine.module, engine.zero_optimization_stage()), dist.is_main)


def _dynamically_filtered(loop: RLLoop, batch: RolloutBatch, rollouts: Rollouts) -> tuple[Rollouts, dict]:
    """DAPO's dynamic sampling: groups whose rewards are all equal (or whose mean is outside
    --dynamic_filtering_reward_range) teach nothing and are dropped (a reward file's ``scores`` are tested instead,
    where it gives them, as OpenRLHF does); groups of other prompts, drawn by a seed of
    the run, the step and the round (so a resumed run draws the same), are generated and scored in their place,
    for at most ``FILTER_ROUNDS`` rounds. A batch still short is filled with dropped groups (counted)."""
    from openpack.core.advantages import keep_groups

    settings, step, wanted = loop.settings, batch.index, len(batch.prompt_ids)
    n = settings.n_samples_per_prompt
    kept, spare, dropped, rounds = [], [], 0, 0
    while True:
        # a reward file's scores where it gives them, as OpenRLHF filters (else the shaped rewards)
        keep = keep_groups(torch.tensor(rollouts.scores or rollouts.rewards), n,
                           settings.dynamic_filtering_reward_range).tolist()
        dropped += keep.count(False)
        for g, good in enumerate(keep):
            (kept if good else spare).append(rollouts.select(range(g * n, (g + 1) * n)))
        if len(kept) >= wanted or rounds == FILTER_ROUNDS:
            break
        rounds += 1
        draw = random.Random(f"{settings.seed}/{step}/refill{rounds}")
        prompts = [loop.prompts[i] for i in draw.sample(range(len(loop.prompts)), min(wanted - len(kept),
                                                                                      len(loop.prompts)))]
        with gathered(loop), loop.colocation or contextlib.nullcontext():
            rollouts = loop.pipeline.generator.rollouts(prompts, f"{step}.refill{rounds}", loop.dist, version=step)
        reward(loop, prompts, rollouts, f"rollout batch {step + 1}, refill {rounds}")
    short = max(wanted - len(kept), 0)
    groups = kept[:wanted] + spare[:short]
    metrics = {"dynamic_filtering/kept_groups": float(min(len(kept), wanted)),
               "dynamic_filtering/dropped_groups": float(dropped), "dynamic_filtering/refill_rounds": float(rounds),
               "dynamic_filtering/short_groups": float(short)}
    return Rollouts.concat(groups), metrics


def _kept_any(loop: RLLoop, batch: RolloutBatch, metrics: dict) -> bool:
    """Say on the console what dynamic filtering kept; False when it kept no group (the step's update is skipped),
    and a RewardError after --dynamic_filtering_max_empty_steps such rollout batches in a row."""
    kept, wanted = int(metrics["dynamic_filtering/kept_groups"]), len(batch.prompt_ids)
    limit, empty = loop.settings.dynamic_filtering_max_empty_steps, loop.empty_steps
    empty.in_a_row = 0 if kept else empty.in_a_row + 1
    line = (f"rollout batch {batch.index + 1}: dynamic filtering kept {kept} of {wanted} groups "
            f"({int(metrics['dynamic_filtering/dropped_groups'])} dropped over "
            f"{int(metrics['dynamic_filtering/refill_rounds'])} refill rounds)")
    if not kept:
        line += f"; no update: every group was dropped ({empty.in_a_row} of {limit} such batches in a row)"
    if loop.dist.is_main:
        loop.run.tracker.message(line)
    if empty.in_a_row >= limit:
        name, bounds = loop.rewards.name, _typed_range(loop.settings)
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


def gathered(loop: RLLoop, needed: bool | None = None):
    """HF generation under ZeRO-3 needs the whole policy on every rank while it generates (``needed``: by default,
    when the policy itself generates)."""
    engine = loop.run.engine
    if needed is None:
        needed = loop.pipeline.generator.backend == "hf"
    if not needed or engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
