"""How an RL step updates: the rollout batch packed into optimizer steps by the planner every trainer uses, then
the policy's clipped loss (and the critic's value loss) weighed per token over each step's totals.

``train_on`` is the whole of it for one rollout batch: experience (``experience.py``), the planned steps, and
one host sync for every step's metrics together.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from openpack.core.advantages import kl
from openpack.core.rl_losses import policy_terms, token_weights, value_terms
from openpack.core.schedule import Batching, RankStep, plan_run, plan_step
from openpack.distributed.engine import optimizer_step
from openpack.distributed.process import DistInfo
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import (StepParts, advantages, in_batch_order, response_segment_ids, response_values,
                                    score_share)
from openpack.rl.settings import RLSettings
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.metrics import DeviceSums, StepMetrics, read_together
from openpack.trainers.router_aux import RouterAux


def accumulated_step(engine, batcher: MicroBatcher, step: RankStep, dist: DistInfo, loss_and_stats,
                     names: tuple[str, ...], finish, norm_name: str = "grad_norm") -> StepMetrics:
    """One optimizer step of ``engine`` over ``step.micro_batches`` (sample ids; a rollout sample is one segment):
    ``loss_and_stats(batch, ids)`` gives the micro-batch's share of the step's loss and one number per ``names``
    after ``loss``, summed on the device; each share is backpropagated (DeepSpeed's mean over ranks undone by the
    world size, as in SFT) and the optimizer steps at the last; an MoE policy adds its router load-balancing loss
    (``trainers/router_aux.py``; the critic never does). Returns the step's metrics, unread: ``finish`` of the sums
    over every rank, and the grad norm as ``norm_name`` (``trainers/metrics.py``); nothing here waits for the
    device."""
    router_aux = RouterAux(engine, step.real_tokens)
    sums, grad_norm = DeviceSums(("loss", *names, *router_aux.names), dist.device), 0.0
    batches = batcher.collate(step.micro_batches)
    for index, (batch, ids) in enumerate(zip(batches, step.micro_batches)):
        last = index == len(batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        loss, numbers = loss_and_stats(batch.to(dist.device), ids)
        aux_loss, aux_sums = router_aux.term(batch.num_tokens)  # the host batch: no device sync
        engine.backward((loss + aux_loss) * dist.world_size)
        if last:
            grad_norm = optimizer_step(engine)
            grad_norm = grad_norm.clone() if isinstance(grad_norm, torch.Tensor) else grad_norm  # next step's own
        else:
            engine.step()
        sums.add(loss, *numbers, *aux_sums)
    return StepMetrics(sums, lambda totals: {**finish(totals), **router_aux.metrics(totals)}, {norm_name: grad_norm})


def update(parts: StepParts, step: RankStep, settings: RLSettings, dist: DistInfo) -> StepMetrics:
    """One optimizer step over this rank's planned micro-batches; the loss is ``sum_t w_t loss_t`` over the step.

    ``w_t`` comes from the step's totals over every rank (``step.label_tokens``: its completion tokens;
    ``step.samples``: its completions), so each micro-batch's part needs no communication.
    """
    def loss_and_stats(batch, ids):
        ids = parts.units.completions(ids)
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

    return accumulated_step(parts.engine, parts.batcher, step, dist, loss_and_stats,
                            ("clipped", "tis_clipped", "entropy", "mismatch", "kl", "tokens"), finish)


def critic_update(parts: StepParts, step: RankStep, settings: RLSettings, dist: DistInfo) -> StepMetrics:
    """One optimizer step of the critic over the same planned micro-batches: the clipped value loss, weighed per
    token over the step's completion tokens (as OpenRLHF's critic averages over tokens)."""
    def loss_and_stats(batch, ids):
        ids = parts.units.completions(ids)
        values = response_values(batch, parts.critic(batch))
        terms = value_terms(values, in_batch_order(ids, parts.values, dist.device),
                            in_batch_order(ids, parts.returns, dist.device), settings.value_clip)
        return (terms.loss / step.label_tokens[0]).sum(), [terms.clipped.sum(), values.detach().sum(), values.numel()]

    def finish(sums):
        tokens = max(sums["tokens"], 1)
        return {"critic_loss": sums["loss"], "value_clip_ratio": sums["clipped"] / tokens,
                "values": sums["values"] / tokens}

    return accumulated_step(parts.critic, parts.batcher, step, dist, loss_and_stats,
                            ("clipped", "values", "tokens"), finish, "critic_grad_norm")


def plan_updates(rollouts: Rollouts, units: Units, train_cfg, world_size: int, seed: int) -> list[list[RankStep]]:
    """The optimizer steps over this rollout batch (``--train_batch_size`` completions each, ``--max_epochs`` passes),
    packed by the same planner as SFT and DPO: ``[rank][step]``. Under ``--prefix_sharing`` each step trains the
    same completions as without it, laid out in shared units (``_shared_steps``); micro-batches list unit ids."""
    lengths = rollouts.lengths()
    labels = [(n,) for n in rollouts.response_lengths()]
    batching = (Batching(max_tokens=train_cfg.max_tokens_per_gpu) if train_cfg.packing_samples
                and train_cfg.use_dynamic_batch else Batching(micro_batch_size=train_cfg.micro_train_batch_size))
    # a batch whose failed episodes were left out (rl/agents) may not split into --train_batch_size: its steps are
    # then the largest size that divides both, so every kept sample trains
    train_batch_size = math.gcd(train_cfg.train_batch_size, len(lengths))
    plan = plan_run(lengths, labels, world_size, batching, train_batch_size, train_cfg.max_epochs, None, seed)
    if not units.shared:  # unit k is completion k: the plan's ids stand as they are
        return plan
    return _shared_steps(plan, units, world_size, batching.max_tokens)


def _shared_steps(plan: list[list[RankStep]], units: Units, world_size: int, max_tokens: int) -> list[list[RankStep]]:
    """Each planned step's completions (over every rank) laid out as shared units and packed again: the same
    samples, label counts and digest, fewer tokens."""
    ranks: list[list[RankStep]] = [[] for _ in range(world_size)]
    for steps in zip(*plan):
        completions = [k for step in steps for micro_batch in step.micro_batches for k in micro_batch]
        unit_ids = units.add(completions)
        packed = plan_step(unit_ids, units.lengths, world_size, max_tokens=max_tokens)
        rows = sum(len(mbs) for mbs in packed.rank_micro_batches)
        for rank, micro_batches in enumerate(packed.rank_micro_batches):
            ranks[rank].append(replace(steps[rank], micro_batches=micro_batches, rows=rows,
                                       real_tokens=packed.real_tokens(units.lengths)))
    return ranks


def train_on(rollouts: Rollouts, engine, scorers: dict, settings: RLSettings, train_cfg, dist: DistInfo,
             pad_token_id: int, seed: int, critic=None, train_actor: bool = True) -> tuple[dict, dict]:
    """Experience (scoring, advantages) and every update of one rollout batch; returns (metrics, timings).
    ``critic``: the critic's engine (GAE; also in ``scorers`` as ``values``); ``train_actor`` False: only the
    critic learns (``--freezing_actor_steps``)."""
    start = time.perf_counter()
    units = Units(rollouts, train_cfg.prefix_sharing, settings.n_samples_per_prompt, train_cfg.max_tokens_per_gpu)
    scored = score_share(units, scorers, train_cfg.max_tokens_per_gpu, dist)
    old, ref, values = scored.get("old"), scored.get("ref"), scored.get("values")
    per_token, returns = advantages(rollouts, settings, old, ref, values)
    lengths = rollouts.response_lengths()
    parts = StepParts(engine, MicroBatcher(units.segments, train_cfg.packing_samples, pad_token_id), units, lengths,
                      per_token, [torch.tensor(b) for b in rollouts.behaviour], old, ref, critic, values, returns)
    experience_s = time.perf_counter() - start
    start = time.perf_counter()
    steps = plan_updates(rollouts, units, train_cfg, dist.world_size, seed)[dist.rank]
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
    if units.shared:  # this rank's tokens in the shared layout, against prompt + completion for each completion
        mine = [u for step in steps for mb in step.micro_batches for u in mb]
        every = rollouts.lengths()
        unshared = sum(every[k][0] for k in units.completions(mine))
        metrics["prefix_sharing/token_ratio"] = sum(sum(units.lengths[u]) for u in mine) / max(unshared, 1)
        metrics["prefix_sharing/split_groups"] = float(units.split_groups)
    if ref is not None and old is not None:
        metrics["kl"] = torch.cat([kl(old[k], ref[k], settings.policy.kl_estimator)
                                   for k in range(len(lengths))]).mean().item()
    return metrics, {"time/experience": experience_s, "time/training": training_s}
