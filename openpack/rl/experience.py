"""How a rollout batch becomes experience: per-token log-probs of the old policy, the reference and the critic,
each scored in one packed pass shared across ranks, then advantages (and returns) per completion token.

The old policy's log-probs are computed in their own pass only when they differ from the update's own (several
updates per rollout, a KL penalty in the reward, or an asynchronous rollout): with one update per rollout the
ratio's denominator is the first forward's log-probs, detached, as TRL does for ``num_iterations=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openpack.core.advantages import gae, kl, sequence_advantages, token_returns, token_rewards, whiten, whitens
from openpack.core.batch import host_to_device
from openpack.core.schedule import plan_scoring
from openpack.distributed.process import DistInfo, all_gather_objects
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.settings import RLSettings
from openpack.trainers.batching import MicroBatcher


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


@torch.no_grad()
def score_share(units: Units, scorers: dict, max_tokens: int, dist: DistInfo) -> dict[str, dict]:
    """Per-token log-probs of every completion under each scorer (``name -> engine``), this rank scoring its share
    of one packed pass over the batch's units, then gathered: ``{name: {completion: [len] tensor}}`` on every
    rank."""
    if not scorers:
        return {}
    lengths = units.rollouts.response_lengths()
    every = units.add(range(len(lengths)))
    share = plan_scoring([units.lengths[u] for u in every], dist.world_size, max_tokens)[dist.rank]
    share = [[every[i] for i in micro_batch] for micro_batch in share]
    mine: dict[str, dict] = {name: {} for name in scorers}
    for ids, batch in zip(share, MicroBatcher(units.segments, packing_samples=True).collate(share)):
        batch, completions = batch.to(dist.device), units.completions(ids)
        for name, scorer in scorers.items():
            mine[name].update(per_completion(completions, response_values(batch, scorer(batch)), lengths))
    merged: dict[str, dict] = {name: {} for name in scorers}
    for part in all_gather_objects(mine):
        for name in scorers:
            merged[name].update(part[name])
    return merged


def advantages(rollouts: Rollouts, settings: RLSettings, old: dict | None, ref: dict | None,
               values: dict | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Each completion's per-token advantages, and with a critic its per-token returns (the value targets); the
    same computation on every rank, which holds the whole batch."""
    lengths = rollouts.response_lengths()
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    penalty = None
    if settings.reward_kl:
        penalty = -settings.kl_coef * torch.cat([kl(old[k], ref[k], settings.policy.kl_estimator)
                                                 for k in range(len(lengths))])
    outcome = torch.tensor(rollouts.rewards)
    if settings.per_turn_reward:  # episodes: each turn's reward on its last sampled token, none as the outcome
        credit = torch.tensor([x for turns in rollouts.turn_credit for x in turns], dtype=torch.float64)
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


@dataclass
class StepParts:
    """What one update step uses: the engine, the batcher over the batch's units, and per-completion tensors."""

    engine: object
    batcher: MicroBatcher
    units: Units
    lengths: list[int]
    advantages: list[torch.Tensor]
    behaviour: list[torch.Tensor]
    old: dict | None
    ref: dict | None
    critic: object = None  # the critic's engine (GAE)
    values: dict | None = None  # the critic's values at rollout time, per sample
    returns: list[torch.Tensor] | None = None  # the critic's targets
