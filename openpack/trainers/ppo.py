"""One step of online RL on packed experience: generate -> reward -> score -> advantages -> update -> sync.

::

    rank 0 (vLLM) or every rank (HF, its share)   prompts -> n completions each, behaviour log-probs
    rank 0                                         rewards (rule function | remote URL | exact match)
    every rank                                     samples = prompt + completion segments, loss on the completion
                                                   reference (and old-policy) log-probs on its share, gathered
                                                   advantages + KL (core, the same on every rank)
    every rank                                     updates: planned packs, token weights from the step's counts
    rank 0 (every rank iterates under ZeRO-3)      weight sync to the engines, policy version += 1

Every rank holds the whole rollout batch (token ids, a few floats per
token): it is small next to a model, and it lets each rank plan the same
packs and compute the same advantages without another exchange. Only the
forwards are split. A completion is one segment: the prompt's tokens are
context, the completion's tokens are the targets, so a packed row of
completions costs no compute on padding.

The old policy's log-probs are computed in their own pass only when they
differ from the update's own (several updates per rollout, or a KL penalty
in the reward): with one update per rollout the ratio's denominator is the
first forward's log-probs, detached, as TRL does for ``num_iterations=1``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from openpack.core.advantages import (clip_rewards, gae, kl, overlong_penalty, sequence_advantages, token_returns,
                                      token_rewards, whiten, whitens)
from openpack.core.batch import Segment, host_to_device
from openpack.core.rl_losses import PolicyLossParams, policy_terms, token_weights, value_terms
from openpack.core.schedule import Batching, RankStep, plan_run, plan_scoring
from openpack.distributed.engine import optimizer_step
from openpack.distributed.process import DistInfo, all_gather_objects, broadcast_object
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.metrics import DeviceSums, StepMetrics, read_together


@dataclass
class RLSettings:
    """What the step needs of the RL flags (``cli/train_ppo.py`` holds them with their help)."""

    n_samples_per_prompt: int
    advantage_estimator: str
    loss_agg_mode: str
    generate_max_len: int
    policy: PolicyLossParams
    kl_coef: float  # --init_kl_coef
    use_kl_loss: bool
    gamma: float = 1.0
    updates_per_rollout: int = 1  # optimizer steps per rollout batch over all PPO epochs
    lambd: float = 1.0  # GAE
    value_clip: float | None = None
    freezing_actor_steps: int = 0  # rollout batches that train only the critic
    overlong_buffer_len: int | None = None  # DAPO's overlong penalty
    overlong_penalty_factor: float = 1.0
    reward_clip_range: tuple[float, float] | None = None
    dynamic_filtering: bool = False  # DAPO's dynamic sampling
    dynamic_filtering_reward_range: tuple[float, float] | None = None
    dynamic_filtering_max_empty_steps: int = 3  # rollout batches in a row that keep no group: stop
    async_staleness: int = 0  # --max_staleness under --async_train: rollouts may be this many versions old

    @property
    def critic(self) -> bool:
        """PPO with a learned value function (GAE) rather than a critic-free estimator."""
        return self.advantage_estimator == "gae"

    @property
    def reward_kl(self) -> bool:
        """A KL penalty in the reward (OpenRLHF's default), rather than a loss term."""
        return self.kl_coef > 0 and not self.use_kl_loss

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_old_pass(self) -> bool:
        # a rollout sampled by an older policy needs the current one's log-probs as the ratio's denominator
        return self.updates_per_rollout > 1 or self.reward_kl or self.async_staleness > 0


@dataclass
class Rollouts:
    """The rollout batch: B = prompts x n completions, prompt-major (completion j of prompt i is i * n + j)."""

    prompt_tokens: list[list[int]]  # [B]
    completion_tokens: list[list[int]]
    behaviour: list[list[float]]  # the engine's log-prob of each completion token
    finished: list[bool]
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version (weight syncs so far) that sampled each

    def segments(self, k: int) -> list[Segment]:
        prompt, completion = self.prompt_tokens[k], self.completion_tokens[k]
        return [Segment(prompt + completion, [False] * len(prompt) + [True] * len(completion), k)]

    def lengths(self) -> list[tuple[int]]:
        return [(len(p) + len(c),) for p, c in zip(self.prompt_tokens, self.completion_tokens)]

    def response_lengths(self) -> list[int]:
        return [len(c) for c in self.completion_tokens]

    def select(self, indices) -> "Rollouts":
        """The samples at ``indices``, in that order (rewards too, once set)."""
        indices = list(indices)
        return Rollouts(**{f.name: [getattr(self, f.name)[k] for k in indices] if getattr(self, f.name) else []
                           for f in fields(self)})

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        return Rollouts(**{f.name: [x for part in parts for x in getattr(part, f.name)] for f in fields(Rollouts)})


def response_values(batch, per_token: torch.Tensor) -> torch.Tensor:
    """The values at the batch's completion tokens, segment by segment in batch order: [N]."""
    return per_token.reshape(-1)[batch.loss_mask.reshape(-1).to(per_token.device)]


def per_sample(batch, values: torch.Tensor, lengths: list[int]) -> dict[int, torch.Tensor]:
    """Split [N] completion-token values of a batch back into one tensor per sample (by the segment table)."""
    ids = batch.sample_index.tolist()
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
def score_share(rollouts: Rollouts, scorers: dict, max_tokens: int, dist: DistInfo) -> dict[str, dict]:
    """Per-token log-probs of every completion under each scorer (``name -> engine``), this rank scoring its share
    of one packed pass, then gathered: ``{name: {sample: [len] tensor}}`` on every rank."""
    if not scorers:
        return {}
    lengths = rollouts.response_lengths()
    share = plan_scoring(rollouts.lengths(), dist.world_size, max_tokens)[dist.rank]
    mine: dict[str, dict] = {name: {} for name in scorers}
    for batch in MicroBatcher(rollouts.segments, packing_samples=True).collate(share):
        batch = batch.to(dist.device)
        for name, scorer in scorers.items():
            mine[name].update(per_sample(batch, response_values(batch, scorer(batch)), lengths))
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
    if settings.critic:
        rewards = token_rewards(torch.tensor(rollouts.rewards), segment_ids, penalty)
        advantage, returns = gae(rewards, torch.cat([values[k] for k in range(len(lengths))]), segment_ids,
                                 settings.gamma, settings.lambd)
        return list(whiten(advantage).split(lengths)), list(returns.split(lengths))
    scalars = sequence_advantages(torch.tensor(rollouts.rewards), settings.n_samples_per_prompt,
                                  settings.advantage_estimator)
    returns = token_returns(scalars, segment_ids, penalty, settings.gamma)
    if whitens(settings.advantage_estimator):
        returns = whiten(returns)
    return list(returns.split(lengths)), None


@dataclass
class StepParts:
    """What one update step uses: the engine, the batcher over the rollouts, and per-sample tensors."""

    engine: object
    batcher: MicroBatcher
    lengths: list[int]
    advantages: list[torch.Tensor]
    behaviour: list[torch.Tensor]
    old: dict | None
    ref: dict | None
    critic: object = None  # the critic's engine (GAE)
    values: dict | None = None  # the critic's values at rollout time, per sample
    returns: list[torch.Tensor] | None = None  # the critic's targets


def accumulated_step(engine, batcher: MicroBatcher, micro_batches: list[list[int]], dist: DistInfo, loss_and_stats,
                     names: tuple[str, ...], finish, norm_name: str = "grad_norm") -> StepMetrics:
    """One optimizer step of ``engine`` over ``micro_batches`` (sample ids; a rollout sample is one segment):
    ``loss_and_stats(batch, ids)`` gives the micro-batch's share of the step's loss and one number per ``names``
    after ``loss``, summed on the device; each share is backpropagated (DeepSpeed's mean over ranks undone by the
    world size, as in SFT) and the optimizer steps at the last. Returns the step's metrics, unread: ``finish`` of
    the sums over every rank, and the grad norm as ``norm_name`` (``trainers/metrics.py``); nothing here waits for
    the device."""
    sums, grad_norm = DeviceSums(("loss", *names), dist.device), 0.0
    batches = batcher.collate(micro_batches)
    for index, (batch, ids) in enumerate(zip(batches, micro_batches)):
        last = index == len(batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        loss, numbers = loss_and_stats(batch.to(dist.device), ids)
        engine.backward(loss * dist.world_size)
        if last:
            grad_norm = optimizer_step(engine)
            grad_norm = grad_norm.clone() if isinstance(grad_norm, torch.Tensor) else grad_norm  # next step's own
        else:
            engine.step()
        sums.add(loss, *numbers)
    return StepMetrics(sums, finish, {norm_name: grad_norm})


def update(parts: StepParts, step: RankStep, settings: RLSettings, dist: DistInfo) -> StepMetrics:
    """One optimizer step over this rank's planned micro-batches; the loss is ``sum_t w_t loss_t`` over the step.

    ``w_t`` comes from the step's totals over every rank (``step.label_tokens``: its completion tokens;
    ``step.samples``: its completions), so each micro-batch's part needs no communication.
    """
    def loss_and_stats(batch, ids):
        entropy = torch.empty(batch.labels.numel(), device=dist.device)
        logp = response_values(batch, parts.engine(batch, entropy=entropy))
        entropy = response_values(batch, entropy)
        old = in_batch_order(ids, parts.old, dist.device) if parts.old is not None else logp.detach()
        ref = in_batch_order(ids, parts.ref, dist.device) if settings.use_kl_loss else None
        behaviour = in_batch_order(ids, parts.behaviour, dist.device)
        terms = policy_terms(logp, old, in_batch_order(ids, parts.advantages, dist.device), settings.policy,
                             ref_logp=ref, behaviour_logp=behaviour if settings.policy.tis_cap else None)
        segment_ids = response_segment_ids(ids, parts.lengths, dist.device)
        weights = token_weights(segment_ids, settings.loss_agg_mode, step.label_tokens[0], step.samples,
                                settings.generate_max_len)
        return (terms.loss * weights).sum(), [terms.clipped.sum(), terms.tis_clipped.sum(), entropy.detach().sum(),
                                              (old - behaviour).abs().sum(), terms.kl.sum(), logp.numel()]

    def finish(sums):
        tokens = max(sums["tokens"], 1)
        return {"policy_loss": sums["loss"], "clip_ratio": sums["clipped"] / tokens,
                "tis_clip_ratio": sums["tis_clipped"] / tokens, "entropy": sums["entropy"] / tokens,
                "vllm_logp_diff": sums["mismatch"] / tokens,
                **({"kl_loss": sums["kl"] / tokens} if settings.use_kl_loss else {})}

    return accumulated_step(parts.engine, parts.batcher, step.micro_batches, dist, loss_and_stats,
                            ("clipped", "tis_clipped", "entropy", "mismatch", "kl", "tokens"), finish)


def critic_update(parts: StepParts, step: RankStep, settings: RLSettings, dist: DistInfo) -> StepMetrics:
    """One optimizer step of the critic over the same planned micro-batches: the clipped value loss, weighed per
    token over the step's completion tokens (as OpenRLHF's critic averages over tokens)."""
    def loss_and_stats(batch, ids):
        values = response_values(batch, parts.critic(batch))
        terms = value_terms(values, in_batch_order(ids, parts.values, dist.device),
                            in_batch_order(ids, parts.returns, dist.device), settings.value_clip)
        return (terms.loss / step.label_tokens[0]).sum(), [terms.clipped.sum(), values.detach().sum(), values.numel()]

    def finish(sums):
        tokens = max(sums["tokens"], 1)
        return {"critic_loss": sums["loss"], "value_clip_ratio": sums["clipped"] / tokens,
                "values": sums["values"] / tokens}

    return accumulated_step(parts.critic, parts.batcher, step.micro_batches, dist, loss_and_stats,
                            ("clipped", "values", "tokens"), finish, "critic_grad_norm")


def plan_updates(rollouts: Rollouts, train_cfg, settings: RLSettings, world_size: int, seed: int) -> list[list[RankStep]]:
    """The optimizer steps over this rollout batch (``--train_batch_size`` completions each, ``--max_epochs`` passes),
    packed by the same planner as SFT and DPO: ``[rank][step]``."""
    lengths = rollouts.lengths()
    labels = [(n,) for n in rollouts.response_lengths()]
    batching = (Batching(max_tokens=train_cfg.max_tokens_per_gpu) if train_cfg.packing_samples
                and train_cfg.use_dynamic_batch else Batching(micro_batch_size=train_cfg.micro_train_batch_size))
    return plan_run(lengths, labels, world_size, batching, train_cfg.train_batch_size, train_cfg.max_epochs, None, seed)


def train_on(rollouts: Rollouts, engine, scorers: dict, settings: RLSettings, train_cfg, dist: DistInfo,
             pad_token_id: int, seed: int, critic=None, train_actor: bool = True) -> tuple[dict, dict]:
    """Experience (scoring, advantages) and every update of one rollout batch; returns (metrics, timings).
    ``critic``: the critic's engine (GAE; also in ``scorers`` as ``values``); ``train_actor`` False: only the
    critic learns (``--freezing_actor_steps``)."""
    start = time.perf_counter()
    scored = score_share(rollouts, scorers, train_cfg.max_tokens_per_gpu, dist)
    old, ref, values = scored.get("old"), scored.get("ref"), scored.get("values")
    per_token, returns = advantages(rollouts, settings, old, ref, values)
    lengths = rollouts.response_lengths()
    parts = StepParts(engine, MicroBatcher(rollouts.segments, train_cfg.packing_samples, pad_token_id), lengths,
                      per_token, [torch.tensor(b) for b in rollouts.behaviour], old, ref, critic, values, returns)
    experience_s = time.perf_counter() - start
    start = time.perf_counter()
    steps = plan_updates(rollouts, train_cfg, settings, dist.world_size, seed)[dist.rank]
    pending = []
    for step in steps:
        if critic is not None:
            critic.train()
            pending.append(critic_update(parts, step, settings, dist))
        if train_actor:
            engine.train()
            pending.append(update(parts, step, settings, dist))
    read = read_together(pending)  # the update loop's one host sync (and all-reduce) per rollout batch
    per_step = len(read) // len(steps)  # critic and/or policy
    results = [{k: v for part in read[i:i + per_step] for k, v in part.items()} for i in range(0, len(read), per_step)]
    training_s = time.perf_counter() - start
    flat = torch.cat(per_token)
    metrics = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
    tokens_per_s = sum(s.real_tokens for s in steps) / training_s  # every rank plans every rank's tokens
    metrics.update({"loss": metrics.get("policy_loss", metrics.get("critic_loss")), "tokens_per_s": tokens_per_s,
                    "training_tokens_per_s": tokens_per_s,
                    "advantages/mean": flat.mean().item(), "advantages/std": flat.std().item() if flat.numel() > 1
                    else 0.0, "optimizer_steps": len(steps)})
    if returns is not None:
        metrics["returns"] = torch.cat(returns).mean().item()
    if ref is not None and old is not None:
        metrics["kl"] = torch.cat([kl(old[k], ref[k], settings.policy.kl_estimator)
                                   for k in range(len(lengths))]).mean().item()
    return metrics, {"time/experience": experience_s, "time/training": training_s}


def rollout_metrics(rollouts: Rollouts, generation_s: float) -> dict:
    """Reward and response-length statistics of a rollout batch (TRL's and OpenRLHF's names)."""
    rewards = torch.tensor(rollouts.rewards, dtype=torch.float64)
    lengths = torch.tensor(rollouts.response_lengths(), dtype=torch.float64)
    return {"reward": rewards.mean().item(), "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response_length/truncated": 1.0 - sum(rollouts.finished) / len(rollouts.finished),
            "generation_tokens_per_s": lengths.sum().item() / max(generation_s, 1e-9),
            "time/generation": generation_s}


def shared_rollouts(local: Rollouts | None, dist: DistInfo, generated_on_all_ranks: bool) -> Rollouts:
    """The whole rollout batch on every rank: every rank's share gathered in prompt order (HF), or rank 0's
    (vLLM engines) broadcast."""
    if not generated_on_all_ranks:
        return broadcast_object(local)
    parts = all_gather_objects(local)
    return Rollouts(**{name: [x for part in parts for x in getattr(part, name)] for name in
                       ("prompt_tokens", "completion_tokens", "behaviour", "finished", "versions")})


def shaped_rewards(raw: list[float], response_lengths: list[int], settings: RLSettings) -> tuple[list[float], dict]:
    """The source's rewards plus DAPO's overlong penalty, then clipped to --reward_clip_range; with metrics."""
    rewards, metrics = torch.tensor(raw, dtype=torch.float32), {}
    if settings.overlong_buffer_len:
        penalty = overlong_penalty(torch.tensor(response_lengths), settings.generate_max_len,
                                   settings.overlong_buffer_len, settings.overlong_penalty_factor)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    if settings.reward_clip_range is not None:
        metrics["reward/source"] = sum(raw) / len(raw)
        rewards = clip_rewards(rewards, settings.reward_clip_range)
    return rewards.tolist(), metrics


def shared_rewards(reward, texts: tuple[list[str], list[str], list[dict]], dist: DistInfo, where: str,
                   sequences: list[list[int]] | None = None) -> list[float]:
    """Rank 0 asks the reward source (once per batch); every rank gets the answer, or raises rank 0's error, so no
    rank is left waiting in a collective when a reward fails."""
    from openpack.trainers.rewards import RewardError

    answer = None
    if dist.is_main:
        try:
            answer = (reward(*texts, batch=where, sequences=sequences), None)
        except RewardError as err:
            answer = (None, str(err))
    values, error = broadcast_object(answer)
    if error is not None:
        raise RewardError(error)
    return values
