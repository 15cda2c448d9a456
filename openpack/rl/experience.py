"""How a rollout batch becomes experience (``make_experience``): per-token log-probs of the old policy, the reference
and the teacher (``--teacher_pretrain``), and the critic's values, each scored in one packed pass shared across
ranks, then advantages (and returns) per completion token, handed to the update as one typed ``Experience``.

Every scorer reads the same packed rows, laid out as the update lays them (``Units``: one segment per completion,
or with ``--prefix_sharing`` a prompt then its completions), and its values are read back at the completions' own
trained tokens by the loss mask, so a distillation term pairs the teacher's and the student's log-probs of one
token whatever the packing.

The old policy's log-probs are computed in their own pass only when they differ from the update's own (several
updates per rollout) or are needed before it (a KL penalty in the reward, a distillation teacher's reverse KL;
``RLSettings.needs_old_pass``): with one update per rollout the ratio's denominator is the first forward's
log-probs, detached, as TRL does for ``num_iterations=1``.

Under ``--ring_attn_size N`` each context group scores its data-parallel share of rows, each rank its part of a row
(``trainers.batching.ContextPlace``), and the group's parts are gathered back into whole rows before the values
are split into completions: every rank then holds the whole batch's experience, as without a ring, and the
advantages (a teacher's term included) are the unsplit ones. The update trains each rank's part of the same rows
(``TrainingTokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from openpack.core.advantages import (clip_rewards, distill_advantages, gae, kl, sequence_advantages, token_returns,
                                      token_rewards, whiten, whitens)
from openpack.core.batch import PackedBatch, host_to_device
from openpack.core.rl_losses import Completions
from openpack.core.schedule import plan_scoring
from openpack.distributed.process import DistInfo, all_gather_objects
from openpack.models.context_parallel import whole_row_values, whole_segment_values
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.settings import RLSettings
from openpack.trainers.batching import ContextPlace, MicroBatcher


def response_values(batch, per_token: torch.Tensor) -> torch.Tensor:
    """The values at the batch's completion tokens, segment by segment in batch order: [N]."""
    return per_token.reshape(-1)[batch.loss_mask.reshape(-1).to(per_token.device)]


def per_completion(ids: list[int], values: torch.Tensor, lengths: list[int]) -> dict[int, torch.Tensor]:
    """Split [N] completion-token values of a batch of the completions ``ids`` (in batch order) back into one tensor
    per completion."""
    return dict(zip(ids, values.detach().cpu().split([lengths[k] for k in ids])))


def in_batch_order(ids: list[int], values: dict[int, torch.Tensor] | list[torch.Tensor], device) -> torch.Tensor:
    """Per-sample tensors of the samples ``ids`` (a batch's, in order) laid out like ``response_values``: [N],
    copied without waiting for the device (``host_to_device``)."""
    return host_to_device(torch.cat([values[k] for k in ids]), device)


def response_segment_ids(ids: list[int], lengths: list[int], device) -> torch.Tensor:
    """Which segment of the batch of samples ``ids`` each completion token belongs to: [N] (0..S-1)."""
    counts = torch.tensor([lengths[k] for k in ids])
    return host_to_device(torch.repeat_interleave(torch.arange(len(counts)), counts), device)


@dataclass
class TrainingTokens:
    """One micro-batch of an update as this rank trains it: ``batch`` on the device (this rank's part of the row
    under ``--ring_attn_size``; ``host_batch`` its copy on the host), ``ids`` the completions of the row in batch
    order, and ``completions`` the completion of each response token held here, with the whole completions'
    lengths and their parts' sums totalled over the context group."""

    host_batch: PackedBatch
    batch: PackedBatch
    ids: list[int]
    held: torch.Tensor | None  # which of the row's response tokens are here (None: every one; ``held_labels``)
    completions: Completions

    def of(self, values: dict[int, torch.Tensor] | list[torch.Tensor]) -> torch.Tensor:
        """Per-completion tensors (by id) at the response tokens held here: [N_r], laid out as ``response_values``
        of ``batch``."""
        whole = in_batch_order(self.ids, values, self.completions.ids.device)
        return whole if self.held is None else whole[self.held]


def training_tokens(experience: "Experience", micro_batches: list[list[int]], device):
    """Each of a rank's planned micro-batches (lists of unit ids) as ``TrainingTokens``, collated when reached."""
    batcher = experience.batcher
    for units, row in zip(micro_batches, batcher.rows(micro_batches)):
        host_batch, held = batcher.context.split(row)
        batch, ids = host_batch.to(device), experience.units.completions(units)
        held = None if held is None else host_to_device(held, device)
        segment_ids = response_segment_ids(ids, experience.lengths, device)
        lengths = host_to_device(torch.tensor([experience.lengths[k] for k in ids]), device)
        completions = Completions(segment_ids if held is None else segment_ids[held], lengths,
                                  total=lambda sums, batch=batch: whole_segment_values(batch, sums))
        yield TrainingTokens(host_batch, batch, ids, held, completions)


Scorer = Callable[[PackedBatch], torch.Tensor]  # a packed batch -> per-token values [1, T] (an engine's forward)


@dataclass
class Scorers:
    """What scores a rollout batch's completions per token before its updates; None where the run needs none."""

    old: Scorer | None = None  # the policy before its updates (``RLSettings.needs_old_pass``)
    ref: Scorer | None = None  # the reference model (a KL term)
    teacher: Scorer | None = None  # on-policy distillation's teacher (``--teacher_pretrain``)
    values: Scorer | None = None  # the critic (GAE)

    def given(self) -> dict[str, Scorer]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class Experience:
    """A rollout batch ready to train on: how its completions are laid out, and per completion (by id, prompt-major)
    the per-token tensors the losses read, each [its trained tokens]."""

    rollouts: Rollouts
    units: Units  # the completions' layout in packed rows (``--prefix_sharing``)
    batcher: MicroBatcher  # collates micro-batches of units
    lengths: list[int]  # trained tokens of each completion
    behaviour: list[torch.Tensor]  # the sampler's log-probs
    advantages: list[torch.Tensor]
    versions: list[torch.Tensor] | None = None  # each token's sampling version (int64; None: synchronous or unknown)
    old: dict[int, torch.Tensor] | None = None  # the policy's before the update (None: the update's own, detached)
    ref: dict[int, torch.Tensor] | None = None
    teacher: dict[int, torch.Tensor] | None = None  # the distillation teacher's
    values: dict[int, torch.Tensor] | None = None  # the critic's at rollout time
    returns: list[torch.Tensor] | None = None  # the critic's targets

    def metrics(self, kl_estimator: str) -> dict[str, float]:
        """The advantages' mean and spread, the returns' mean, the KL of the old policy to the reference, and with a
        teacher the student's reverse KL to it (k1, the mean over completion tokens of log pi - log nu)."""
        flat = torch.cat(self.advantages)
        metrics = {"advantages/mean": flat.mean().item(),
                   "advantages/std": flat.std().item() if flat.numel() > 1 else 0.0}
        if self.returns is not None:
            metrics["returns"] = torch.cat(self.returns).mean().item()
        if self.ref is not None and self.old is not None:
            metrics["kl"] = torch.cat([kl(self.old[k], self.ref[k], kl_estimator)
                                       for k in range(len(self.lengths))]).mean().item()
        if self.teacher is not None:
            metrics["distill/reverse_kl"] = torch.cat([kl(self.old[k], self.teacher[k])
                                                       for k in range(len(self.lengths))]).mean().item()
        return metrics


def make_experience(rollouts: Rollouts, scorers: Scorers, settings: RLSettings, dist: DistInfo,
                    pad_token_id: int, context: ContextPlace = ContextPlace()) -> Experience:
    """Score the batch (this rank's share of one packed pass per scorer, gathered) and compute its advantages, the
    same on every rank; ``context``: this rank's place in its context group (``--ring_attn_size``)."""
    units = Units(rollouts, settings.prefix_sharing, settings.n_samples_per_prompt, settings.row_tokens)
    scored = score_share(units, scorers.given(), settings.row_tokens, dist, context)
    old, ref, teacher, values = scored.get("old"), scored.get("ref"), scored.get("teacher"), scored.get("values")
    per_token, returns = advantages(rollouts, settings, old, ref, values, teacher)
    return Experience(rollouts=rollouts, units=units,
                      batcher=MicroBatcher(units.segments, settings.packing_samples, pad_token_id, context),
                      lengths=rollouts.response_lengths(), behaviour=[torch.tensor(b) for b in rollouts.behaviour],
                      versions=[torch.tensor(rollouts.sampled_by(k), dtype=torch.int64) for k in range(rollouts.size)]
                      if settings.async_staleness > 0 and rollouts.versions else None,  # read only when asynchronous
                      advantages=per_token, old=old, ref=ref, teacher=teacher, values=values, returns=returns)


@torch.no_grad()
def score_share(units: Units, scorers: dict, max_tokens: int, dist: DistInfo,
                context: ContextPlace = ContextPlace()) -> dict[str, dict]:
    """Per-token log-probs of every completion under each scorer (``name -> engine``), this rank scoring its share
    of one packed pass over the batch's units (its part of its context group's rows of ``max_tokens``), then
    gathered: ``{name: {completion: [len] tensor}}`` on every rank."""
    if not scorers:
        return {}
    lengths = units.rollouts.response_lengths()
    every = units.add(range(len(lengths)))
    groups = dist.world_size // context.size  # data-parallel ranks: a context group scores one share
    share = plan_scoring([units.lengths[u] for u in every], groups, max_tokens)[dist.rank // context.size]
    share = [[every[i] for i in micro_batch] for micro_batch in share]
    mine: dict[str, dict] = {name: {} for name in scorers}
    for ids, row in zip(share, MicroBatcher(units.segments, packing_samples=True).rows(share)):
        part, completions = context.part(row).to(dist.device), units.completions(ids)
        for name, scorer in scorers.items():
            per_token = whole_row_values(part, scorer(part))
            mine[name].update(per_completion(completions, response_values(row, per_token), lengths))
    merged: dict[str, dict] = {name: {} for name in scorers}
    for part in all_gather_objects(mine):
        for name in scorers:
            merged[name].update(part[name])
    return merged


def advantages(rollouts: Rollouts, settings: RLSettings, old: dict | None, ref: dict | None,
               values: dict | None = None,
               teacher: dict | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Each completion's per-token advantages, and with a critic its per-token returns (the value targets); the
    same computation on every rank, which holds the whole batch. With a teacher, each token's distillation term
    is added to the estimator's advantage (``core.advantages.distill_advantages``); the critic's returns stay the
    task's."""
    task, returns = task_advantages(rollouts, settings, old, ref, values)
    if not settings.distills:
        return task, returns
    return [a + distill_advantages(old[k], teacher[k], settings.distill_coef) for k, a in enumerate(task)], returns


def task_advantages(rollouts: Rollouts, settings: RLSettings, old: dict | None, ref: dict | None,
                    values: dict | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The estimator's per-token advantages from the rewards (and the KL penalty), and the critic's returns."""
    lengths = rollouts.response_lengths()
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    penalty = None
    if settings.reward_kl:
        penalty = -settings.kl_coef * torch.cat([kl(old[k], ref[k], settings.policy.kl_estimator)
                                                 for k in range(len(lengths))])
    outcome = torch.tensor(rollouts.rewards)
    if settings.per_turn_reward:  # episodes: each turn's reward on its last sampled token, none as the outcome
        credit = torch.tensor([x for turns in rollouts.turn_credit for x in turns], dtype=torch.float64)
        credit = clip_rewards(credit, settings.reward_clip_range)  # each turn's reward, as an episode's is clipped
        penalty = credit if penalty is None else penalty.double() + credit
        outcome = torch.zeros_like(outcome)
    if settings.critic:
        rewards = token_rewards(outcome, segment_ids, penalty)
        advantage, returns = gae(rewards, torch.cat([values[k] for k in range(len(lengths))]), segment_ids,
                                 settings.gamma, settings.lambd)
        return list(whiten(advantage).split(lengths)), list(returns.split(lengths))
    scalars = sequence_advantages(outcome, settings.n_samples_per_prompt, settings.advantage_estimator)
    returns = token_returns(scalars, segment_ids, penalty, settings.gamma)
    if whitens(settings.advantage_estimator):
        returns = whiten(returns)
    return list(returns.split(lengths)), None
