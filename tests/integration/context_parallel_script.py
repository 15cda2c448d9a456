"""One rank of test_context_parallel.py: ``python context_parallel_script.py RANK WORLD PORT OUT.json``.

For each case of ``CASES`` the rank builds the tiny model and the packed row, runs its part of the split row
(log-probs, then the gradient of a weighted sum of them, its local part only), sums log-probs and gradients over
the group, and compares them with the unsplit row's. Then the pair losses (``run_pairs``): DPO's (policy and
reference sums through the trainer's ``PairTable``) and a reward model's, each rank computing every pair's loss
from the group's sums and its own part of the gradient, the parts summed as DeepSpeed does. Then online RL's
completions (``run_completions``): the scoring pass through ``rl.experience.score_share`` and the policy loss as
``rl.update.policy_step`` forms it from ``training_tokens``. Rank 0 writes the largest errors to OUT.json.
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from openpack.core.batch import CHOSEN, REJECTED, Segment, collate_packed
from openpack.core.context_parallel import shard_batch, split_row
from openpack.core.logprobs import pair_segments, segment_logprobs
from openpack.core.losses import LossParams, pair_losses
from openpack.core.reward_losses import reward_pair_losses
from openpack.core.rl_losses import PolicyLossParams, policy_terms, token_weights
from openpack.distributed.process import DistInfo, exit_now
from openpack.models.context_parallel import last_token_readout, set_context_group, whole_segment_values
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.models.reward import PackedRewardModel
from openpack.models.verify import random_segments
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import Experience, response_values, score_share, training_tokens
from openpack.trainers.batching import ContextPlace, MicroBatcher
from openpack.trainers.dpo import PairTable
from openpack.trainers.reference import ModelReference

# A 64-token row over 2 ranks of 32: the 40-token document is longer than a rank's share and straddles the split;
# document 3 (one token, an odd index) lies on rank 1 only (test_context_parallel.py checks both from the split).
LENGTHS = [9, 40, 3, 1, 11]
# name -> (tiny architecture, config overrides, the window the split balances for, whether document boundaries are
# ignored: the whole row split as one document, the mistake a ring without cu_seqlens makes)
CASES = {
    "llama": ("llama", {}, None, False),
    "qwen2_sliding_window": ("qwen2_sliding_window", {}, 8, False),
    "llama_gqa_8_over_2": ("llama", dict(num_attention_heads=8, num_key_value_heads=2), None, False),
    "gemma2_softcap": ("gemma2", {}, None, False),
    "llama_dynamic_rope": ("llama_dynamic_rope", {}, None, False),
    # --gradient_checkpointing: each layer's forward, its K/V all-gather included, runs again in the backward
    "llama_gradient_checkpointing": ("llama", dict(gradient_checkpointing=True), None, False),
    "llama_boundaries_ignored": ("llama", {}, None, True),
}


def run_case(arch, overrides, window, ignore_boundaries, rank, world):
    overrides = dict(overrides)
    checkpointed = overrides.pop("gradient_checkpointing", False)
    model = tiny_causal_lm(arch, seed=0, **overrides)
    if checkpointed:  # as models.loading turns it on
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packed = PackedCausalLM(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = collate_packed(random_segments(LENGTHS, model.config.vocab_size, seed=7))
    weights = torch.linspace(0.5, 1.5, batch.num_tokens)  # a weighted sum, so every position matters

    reference = packed(batch)
    reference_grads = torch.autograd.grad((reference * weights).sum(), params)

    cu_seqlens = torch.tensor([0, batch.num_tokens], dtype=torch.int32) if ignore_boundaries else batch.cu_seqlens
    shard = split_row(cu_seqlens, world, window)[rank]
    local = packed(shard_batch(batch, shard))
    grads = torch.autograd.grad((local * weights[shard.token_index]).sum(), params)
    logprobs = torch.zeros(batch.num_tokens).index_put_((shard.token_index,), local.detach())
    dist.all_reduce(logprobs)
    for g in grads:
        dist.all_reduce(g)
    return {
        "logprob_error": (logprobs - reference).abs().max().item(),
        "grad_error": max((a - b).abs().max().item() for a, b in zip(grads, reference_grads)),
        "grad_scale": max(b.abs().max().item() for b in reference_grads),
    }


# Three pairs (chosen, rejected) in one 73-token row over 2 ranks (test_context_parallel.py checks the split):
# pair 0's chosen (40 tokens, a 30-token prompt) outgrows a rank's share, its labels all in rank 0's tail chunk;
# pair 1's chosen (2 tokens) ends on rank 1 and its rejected on rank 0; pair 2's chosen ends in 3 skipped tokens
# (the reward model's pad id) that rank 0 holds, so its reward is read on rank 1.
PAIR_LENGTHS = [(40, 3), (2, 9), (12, 7)]
PROMPT_LENGTHS = [(30, 1), (1, 4), (5, 3)]
SKIP_TOKEN, SKIPPED = 3, (4, 3)  # segment 4 ends in 3 SKIP_TOKENs


def pair_row(vocab_size: int) -> list[Segment]:
    """PAIR_LENGTHS as chosen and rejected segments, targets after each prompt; no SKIP_TOKEN but where placed."""
    lengths = [n for pair in PAIR_LENGTHS for n in pair]
    prompts = [n for pair in PROMPT_LENGTHS for n in pair]
    segments = []
    for i, seg in enumerate(random_segments(lengths, vocab_size, seed=11)):
        tokens = [SKIP_TOKEN + 1 if t == SKIP_TOKEN else t for t in seg.tokens]
        if i == SKIPPED[0]:
            tokens[-SKIPPED[1]:] = [SKIP_TOKEN] * SKIPPED[1]
        targets = [k >= prompts[i] for k in range(len(tokens))]
        segments.append(Segment(tokens, targets, sample_index=i // 2, role=(CHOSEN, REJECTED)[i % 2]))
    return segments


def run_pairs(rank, world):
    """DPO (sigmoid + IPO: IPO reads the label counts) and reward-model pair losses of the split row against the
    whole row: loss, per-pair values and the summed gradients; and where each reward was read."""
    policy = tiny_causal_lm("llama", seed=0)
    reference = ModelReference(PackedCausalLM(tiny_causal_lm("llama", seed=1)), torch.device("cpu"))
    policy.config.pad_token_id = SKIP_TOKEN
    torch.manual_seed(5)
    policy.score = torch.nn.Linear(policy.config.hidden_size, 1, bias=False)  # a reward model's value head
    packed, rewards = PackedCausalLM(policy), PackedRewardModel(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    whole = collate_packed(pair_row(policy.config.vocab_size))
    part = shard_batch(whole, split_row(whole.cu_seqlens, world)[rank])

    def dpo(batch, combine=True):
        sums = segment_logprobs(batch, packed(batch)).sum
        sums = whole_segment_values(batch, sums) if combine else sums
        logps = PairTable(batch, torch.device("cpu")).logps(sums, reference.segment_sums(batch))
        return pair_losses(logps, LossParams(beta=0.5), ["sigmoid", "ipo"], [1.0, 0.1]).sum()

    def rm(batch):
        values = rewards(batch)
        _, chosen, rejected = pair_segments(batch)
        return reward_pair_losses(values[chosen], values[rejected], "sigmoid").sum(), values

    results = {}
    for name, loss_of in (("dpo_pairs", lambda b: (dpo(b), None)), ("rm_pairs", rm)):
        (loss, values), (split_loss, split_values) = loss_of(whole), loss_of(part)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        split_grads = torch.autograd.grad(split_loss, params, allow_unused=True)
        errors = []
        for mine, theirs in zip(split_grads, grads):
            if theirs is not None:
                dist.all_reduce(mine)
                errors.append((mine - theirs).abs().max().item())
        results[name] = {"loss_error": (split_loss - loss).abs().item(), "grad_error": max(errors),
                         "grad_scale": max(g.abs().max().item() for g in grads if g is not None)}
        if values is not None:
            results[name]["value_error"] = (split_values - values).abs().max().item()
    # the guard: each rank's pair losses from its own part of the sums, added over the ranks, must not pass
    alone = dpo(part, combine=False).detach()
    dist.all_reduce(alone)
    results["dpo_pairs_not_combined"] = {"loss_error": (alone - dpo(whole)).abs().item()}
    held = last_token_readout(part, SKIP_TOKEN)[1].long()
    readers = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(readers, held * rank)
    results["rm_pairs"]["read_on_rank"] = torch.stack(readers).sum(0).tolist()  # per segment
    return results


# Three completions (prompt, completion tokens) in one 66-token row over 2 ranks: completion 0 (45 tokens) outgrows a
# rank's share, so each rank holds part of its response; completion 2 is an episode whose observation tokens (a hole
# in its targets) are context, not trained. Per-token log-ratio shifts of the sampler (behaviour) that differ within
# completion 0 make seq-mask-tis's geometric mean a function of the whole completion.
COMPLETIONS = [(5, 40), (2, 3), (4, 12)]
EPISODE_TARGETS = [True] * 5 + [False] * 3 + [True] * 4
SAMPLER_SHIFT = [[0.25] * 20 + [-0.15] * 20, [0.2] * 3, [0.02] * 9]


def run_completions(rank, world):
    """GSPO (its sequence ratio) with seq-mask-tis (its geometric mean) and seq_mean_token_mean's weights (each
    completion's whole length): the loss and summed gradients of each rank's part of the row against the whole
    row's, and the scoring pass (old-policy log-probs gathered back into whole rows) against the unsplit pass. The
    guard: each rank's sequence quantities from its own part of the sums."""
    model = tiny_causal_lm("llama", seed=0)
    packed = PackedCausalLM(model)
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(13)
    tokens = [torch.randint(3, model.config.vocab_size, (n + m,), generator=generator).tolist() for n, m in COMPLETIONS]
    targets = [[True] * m for _, m in COMPLETIONS[:2]] + [EPISODE_TARGETS]
    rollouts = Rollouts([t[:n] for t, (n, _) in zip(tokens, COMPLETIONS)],
                        [t[n:] for t, (n, _) in zip(tokens, COMPLETIONS)],
                        [[0.0] * sum(mask) for mask in targets], [True] * 3, targets=targets)
    lengths = rollouts.response_lengths()
    units = Units(rollouts, shared=False)
    cpu = torch.device("cpu")

    def scored(context, dist_info):
        return score_share(units, {"old": packed}, 2 * sum(n + m for n, m in COMPLETIONS), dist_info, context)["old"]

    whole_scores = scored(ContextPlace(), DistInfo(0, 1, 0, cpu))
    split_scores = scored(ContextPlace(world, rank), DistInfo(rank, world, 0, cpu))
    noise = torch.Generator().manual_seed(17)
    old = {k: whole_scores[k] + 0.05 * torch.randn(n, generator=noise) for k, n in enumerate(lengths)}
    behaviour = [old[k] - torch.tensor(shift) for k, shift in enumerate(SAMPLER_SHIFT)]
    advantages = [torch.randn(n, generator=noise) for n in lengths]
    settings = PolicyLossParams(eps_low=0.02, eps_high=0.02, loss_type="gspo", correction="seq-mask-tis",
                                correction_low=0.9, correction_high=1.1)

    def loss_of(context, combine=True):
        experience = Experience(rollouts=rollouts, units=units, batcher=MicroBatcher(units.segments, True, 0, context),
                                lengths=lengths, behaviour=behaviour, advantages=advantages, old=old)
        (held,) = training_tokens(experience, [[0, 1, 2]], cpu)
        completions = held.completions if combine else dataclasses.replace(held.completions, total=lambda sums: sums)
        logp = response_values(held.batch, packed(held.batch))
        terms = policy_terms(logp, held.of(old), held.of(advantages), settings,
                             behaviour_logp=held.of(behaviour), completions=completions)
        return (terms.loss * token_weights(completions, "seq_mean_token_mean", sum(lengths), 3)).sum(), terms

    loss, terms = loss_of(ContextPlace())
    grads = torch.autograd.grad(loss, params)
    split_loss, split_terms = loss_of(ContextPlace(world, rank))
    split_grads = torch.autograd.grad(split_loss, params)
    for g in split_grads:
        dist.all_reduce(g)
    split_loss = split_loss.detach()
    dist.all_reduce(split_loss)
    masked = split_terms.masked.sum()
    dist.all_reduce(masked)
    alone = loss_of(ContextPlace(world, rank), combine=False)[0].detach()
    dist.all_reduce(alone)
    return {"rl_completions": {
        "score_error": max((split_scores[k] - whole_scores[k]).abs().max().item() for k in range(3)),
        "loss_error": (split_loss - loss).abs().item(), "loss": loss.item(),
        "grad_error": max((a - b).abs().max().item() for a, b in zip(split_grads, grads)),
        "grad_scale": max(b.abs().max().item() for b in grads),
        "masked_tokens": [int(terms.masked.sum()), int(masked)], "clipped_tokens": int(terms.clipped.sum()),
        "response_tokens_per_rank": all_gathered(split_terms.loss.numel(), world)},
        "rl_completions_not_combined": {"loss_error": (alone - loss).abs().item()}}


def all_gathered(value: int, world: int) -> list[int]:
    values = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(values, torch.tensor(value))
    return [int(v) for v in values]


def main(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    set_context_group(dist.group.WORLD)
    results = {name: run_case(*case, rank, world) for name, case in CASES.items()}
    results.update(run_pairs(rank, world))
    results.update(run_completions(rank, world))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    set_context_group(None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    exit_now(0)  # not through finalisation: a gloo worker may still be releasing the last all-gather's tensors
