"""How an RL step updates (``train_on``): the rollout batch's completions packed into optimizer steps by the planner
every trainer uses, then, step by step, the critic's value loss and the policy's clipped loss, each weighed per
token over the step's totals; one host sync reads every step's metrics together.

Each step's loop is written out as in ``trainers/sft.py``: per micro-batch a forward, the loss, a backward (times
the world size: DeepSpeed's mean over ranks undone), statistics added on the device by name, and the optimizer
step at the last micro-batch. Inside a step one pair of numbers is read to the host, at the optimizer step: its loss
and grad norm, to skip a non-finite update (``distributed/nonfinite.py``); none per micro-batch
(``tests/integration/test_step_syncs.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from openpack.core.rl_losses import policy_terms, token_weights, value_terms
from openpack.core.schedule import RankStep, plan_run, plan_step
from openpack.distributed.engine import optimizer_step
from openpack.distributed.process import DistInfo
from openpack.rl.experience import Experience, in_batch_order, response_segment_ids, response_values
from openpack.rl.settings import RLSettings
from openpack.trainers.metrics import DeviceSums, StepMetrics, maximum_over_ranks, read_together
from openpack.trainers.router_aux import RouterAux

POLICY_SUMS = ("loss", "clipped", "tis_clipped", "entropy", "mismatch", "kl", "tokens")
CORRECTION_SUMS = ("masked_tokens", "masked_sequences", "sequences", "ratio")  # with --is_correction_type
ASYNC_SUMS = ("old_version_tokens",)  # with --async_train: tokens sampled by a version older than the one trained
CRITIC_SUMS = ("loss", "clipped", "values", "tokens")


def train_on(experience: Experience, engine, critic, settings: RLSettings, dist: DistInfo, seed: int,
             train_actor: bool = True, version: int = 0) -> tuple[dict, int]:
    """Every optimizer step of one rollout batch: the critic's (``critic``: its engine, under GAE), then the
    policy's, step by step; ``train_actor`` False trains only the critic (``--freezing_actor_steps``); ``version``:
    the policy version the batch trains (weight syncs so far). Returns the metrics, each averaged over the steps,
    and the real tokens the steps trained over every rank."""
    steps = plan_updates(experience, settings, dist.world_size, seed)[dist.rank]
    pending = []
    for step in steps:
        if critic is not None:
            critic.train()
            pending.append(critic_step(critic, experience, step, settings, dist))
        if train_actor:
            engine.train()
            pending.append(policy_step(engine, experience, step, settings, dist, version))
    read = read_together(pending)  # the update's one host sync (and all-reduce) per rollout batch
    metrics = {key: _over_steps(key, [r[key] for r in read if key in r]) for key in dict.fromkeys(k for r in read
                                                                                                 for k in r)}
    metrics.update(loss=metrics.get("policy_loss", metrics.get("critic_loss")), optimizer_steps=len(steps),
                   **_sharing_metrics(experience, steps))
    return metrics, sum(s.real_tokens for s in steps)  # every rank plans every rank's tokens


def policy_step(engine, experience: Experience, step: RankStep, settings: RLSettings, dist: DistInfo,
                version: int = 0) -> StepMetrics:
    """One optimizer step of the policy over this rank's planned micro-batches; its loss is ``sum_t w_t loss_t``
    (``core/rl_losses.py``), ``w_t`` from the step's totals over every rank (``step.label_tokens``: its completion
    tokens; ``step.samples``: its completions), so each micro-batch's part needs no communication. An MoE policy
    adds its router load-balancing loss (``trainers/router_aux.py``). Asynchronous, it counts the tokens an older
    version than ``version`` (the one trained) sampled: each token's own version, in the order the loss reads
    its behaviour log-prob (``async/old_version_tokens``, their share)."""
    router_aux, correcting = RouterAux(engine, step.real_tokens), settings.policy.correction is not None
    stale = settings.async_staleness > 0 and experience.versions is not None
    sums = DeviceSums(POLICY_SUMS + (CORRECTION_SUMS if correcting else ()) + (ASYNC_SUMS if stale else ())
                      + router_aux.names, dist.device)
    grad_norm, ratio_max = 0.0, torch.zeros((), device=dist.device)
    micro_batches = experience.batcher.collate(step.micro_batches)
    for index, (host_batch, units) in enumerate(zip(micro_batches, step.micro_batches)):
        last = index == len(micro_batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        batch, ids = host_batch.to(dist.device), experience.units.completions(units)
        entropy = torch.empty(batch.labels.numel(), device=dist.device)
        logp = response_values(batch, engine(batch, entropy=entropy))
        entropy = response_values(batch, entropy)
        old = in_batch_order(ids, experience.old, dist.device) if experience.old is not None else logp.detach()
        ref = in_batch_order(ids, experience.ref, dist.device) if settings.use_kl_loss else None
        behaviour = in_batch_order(ids, experience.behaviour, dist.device)
        segment_ids = response_segment_ids(ids, experience.lengths, dist.device)
        terms = policy_terms(logp, old, in_batch_order(ids, experience.advantages, dist.device), settings.policy,
                             ref_logp=ref, behaviour_logp=behaviour if correcting else None,
                             segment_ids=segment_ids, entropy=entropy)
        weights = token_weights(segment_ids, settings.loss_agg_mode, step.label_tokens[0], step.samples,
                                settings.generate_max_len)
        loss = (terms.loss * weights).sum()
        aux_loss, aux_sums = router_aux.term(host_batch.num_tokens)  # the host batch: no device sync
        engine.backward((loss + aux_loss) * dist.world_size)
        corrections = _correction_sums(terms, segment_ids, len(ids)) if correcting else {}
        if stale:
            corrections["old_version_tokens"] = (in_batch_order(ids, experience.versions, dist.device) < version).sum()
        if correcting:
            ratio_max = torch.maximum(ratio_max, terms.is_ratio.max())
        sums.add(loss=loss, clipped=terms.clipped.sum(), tis_clipped=terms.tis_clipped.sum(),
                 entropy=entropy.detach().sum(), mismatch=(old - behaviour).abs().sum(), kl=terms.kl.sum(),
                 tokens=logp.numel(), **corrections, **aux_sums)
        grad_norm = _boundary_step(engine, last, grad_norm, sums)

    def metrics(totals: dict[str, float]) -> dict:
        tokens = max(totals["tokens"], 1)
        return {"policy_loss": totals["loss"], "clip_ratio": totals["clipped"] / tokens,
                "tis_clip_ratio": totals["tis_clipped"] / tokens, "entropy": totals["entropy"] / tokens,
                "vllm_logp_diff": totals["mismatch"] / tokens,
                **({"kl_loss": totals["kl"] / tokens} if settings.use_kl_loss else {}), **router_aux.metrics(totals),
                **({"is_correction/masked_tokens": totals["masked_tokens"] / tokens,
                    "is_correction/masked_sequences": totals["masked_sequences"] / max(totals["sequences"], 1),
                    "is_correction/ratio_mean": totals["ratio"] / tokens} if correcting else {}),
                **({"async/old_version_tokens": totals["old_version_tokens"] / tokens} if stale else {})}

    values = {"grad_norm": grad_norm, "skipped_steps": engine.step_guard.skipped}
    if correcting:  # a collective on the device, once per step: read with the sums
        values["is_correction/ratio_max"] = maximum_over_ranks(ratio_max)
    return StepMetrics(sums, metrics, values)


def _correction_sums(terms, segment_ids: torch.Tensor, sequences: int) -> dict[str, torch.Tensor | int]:
    """A micro-batch's rollout-correction counts: masked tokens, completions with a masked token, the ratios' sum."""
    masked_per_sequence = torch.zeros(sequences, device=segment_ids.device).index_add_(0, segment_ids,
                                                                                     terms.masked.float())
    return {"masked_tokens": terms.masked.sum(), "masked_sequences": (masked_per_sequence > 0).sum(),
            "sequences": sequences, "ratio": terms.is_ratio.sum()}


def _over_steps(key: str, values: list[float]) -> float:
    """A metric over a rollout batch's optimizer steps: the largest of a maximum or a running count, else the mean."""
    return max(values) if key.endswith(("_max", "skipped_steps")) else sum(values) / len(values)  # counts so far


def critic_step(critic, experience: Experience, step: RankStep, settings: RLSettings, dist: DistInfo) -> StepMetrics:
    """One optimizer step of the critic over the same planned micro-batches: the clipped value loss, weighed per
    token over the step's completion tokens (as OpenRLHF's critic averages over tokens)."""
    sums, grad_norm = DeviceSums(CRITIC_SUMS, dist.device), 0.0
    micro_batches = experience.batcher.collate(step.micro_batches)
    for index, (host_batch, units) in enumerate(zip(micro_batches, step.micro_batches)):
        last = index == len(micro_batches) - 1
        critic.set_gradient_accumulation_boundary(last)
        batch, ids = host_batch.to(dist.device), experience.units.completions(units)
        values = response_values(batch, critic(batch))
        terms = value_terms(values, in_batch_order(ids, experience.values, dist.device),
                            in_batch_order(ids, experience.returns, dist.device), settings.value_clip)
        loss = (terms.loss / step.label_tokens[0]).sum()
        critic.backward(loss * dist.world_size)
        sums.add(loss=loss, clipped=terms.clipped.sum(), values=values.detach().sum(), tokens=values.numel())
        grad_norm = _boundary_step(critic, last, grad_norm, sums)

    def metrics(totals: dict[str, float]) -> dict:
        tokens = max(totals["tokens"], 1)
        return {"critic_loss": totals["loss"], "value_clip_ratio": totals["clipped"] / tokens,
                "values": totals["values"] / tokens}

    return StepMetrics(sums, metrics, {"critic_grad_norm": grad_norm, "critic_skipped_steps": critic.step_guard.skipped})


def _boundary_step(engine, last: bool, grad_norm, sums: DeviceSums):
    """After a micro-batch's backward and its ``sums``: the optimizer step at the step's last, applied only if the
    step's loss (``sums``' "loss" over every rank) and grad norm are finite (its grad norm, unread, a copy of its
    own since DeepSpeed reuses the tensor), else only DeepSpeed's micro-step count."""
    if not last:
        engine.step()
        return grad_norm
    norm = optimizer_step(engine, sums.get("loss"))
    return norm.clone() if isinstance(norm, torch.Tensor) else norm


def plan_updates(experience: Experience, settings: RLSettings, world_size: int, seed: int) -> list[list[RankStep]]:
    """The optimizer steps over this rollout batch (``--train_batch_size`` completions each, ``--max_epochs`` passes),
    packed by the same planner as SFT and DPO: ``[rank][step]``. Under ``--prefix_sharing`` each step trains the
    same completions as without it, laid out in shared units (``_shared_steps``); micro-batches list unit ids."""
    rollouts, units = experience.rollouts, experience.units
    lengths = rollouts.lengths()
    labels = [(n,) for n in experience.lengths]
    # a batch whose failed episodes were left out (rl/agents) may not split into --train_batch_size: its steps are
    # then the largest size that divides both, so every kept sample trains
    train_batch_size = math.gcd(settings.train_batch_size, len(lengths))
    plan = plan_run(lengths, labels, world_size, settings.batching, train_batch_size, settings.max_epochs, None, seed)
    if not units.shared:  # unit k is completion k: the plan's ids stand as they are
        return plan
    return _shared_steps(plan, units, world_size, settings.batching.max_tokens)


def _shared_steps(plan: list[list[RankStep]], units, world_size: int, max_tokens: int) -> list[list[RankStep]]:
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


def _sharing_metrics(experience: Experience, steps: list[RankStep]) -> dict:
    """Under --prefix_sharing: this rank's tokens in the shared layout against prompt + completion for each
    completion, and how many groups were split at the row cap."""
    units = experience.units
    if not units.shared:
        return {}
    mine = [u for step in steps for mb in step.micro_batches for u in mb]
    every = experience.rollouts.lengths()
    unshared = sum(every[k][0] for k in units.completions(mine))
    return {"prefix_sharing/token_ratio": sum(sum(units.lengths[u]) for u in mine) / max(unshared, 1),
            "prefix_sharing/split_groups": float(units.split_groups)}
