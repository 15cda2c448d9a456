"""GRPO in one file, to read: what ``openpack train_grpo`` does on its built-in demo, top to bottom.

1. Loads the SFT demo model (trained first and cached, as ``openpack train_grpo`` does), which answers
   two-digit sums right but wordily ("it is 42"), and the demo's prompts.
2. Each step samples n completions of a batch of prompts with transformers' ``generate``, scores them with
   the demo's exact-match reward (1.0 for the bare right answer only), normalises each reward within its
   prompt's group (GRPO's advantage), and takes optimizer steps on the clipped policy loss over packed rows.
3. Prints held-out exact match (greedy, every held-out problem) before and after.

How it departs from the full trainer (``openpack/rl/``), whose numbers it reproduces:
``tests/integration/test_grpo_minimal.py`` checks that the first rollout batch's loss and grad norm equal
``openpack train_grpo --launcher local --rollout_backend hf``'s to 1e-5 (relative), same seed and flags.

1. One process; no DeepSpeed, Ray or vLLM: plain ``torch.optim.AdamW`` at a constant learning rate (the
   demo's schedule: no warmup), gradients clipped by ``clip_grad_norm_``; fp32.
2. HF ``generate`` on the policy itself (``--rollout_backend hf``), so there are no weights to sync.
3. One packed segment per completion; by default the trainer lays a prompt out once before its
   completions (``--prefix_sharing``, the same numbers).
4. The demo only: its exact-match reward, no KL term or reference model, no critic, no checkpoints, no
   metrics file, no asynchronous generation, dynamic filtering or multi-turn episodes.

openpack parts it uses: ``core`` (``packing.shuffled_epoch``, ``schedule.plan_run`` and ``plan_scoring``,
``batch.Segment`` and ``collate_packed``, ``logprobs.token_logprobs``, ``advantages.sequence_advantages``,
``rl_losses.policy_terms`` and ``token_weights``); ``models.loading`` and ``models.packed.packed_forward`` (a
packed forward needs openpack's attention function); ``rl.rewards.exact_match_reward``; the sampling seeds of
``rl.generation.request_seed`` and ``rollout.hf_engine.combined_seed``; the demo's model, prompts and
held-out evaluation (``config.commands.demo_sft_model``, ``data.demo_task``, ``trainers.demo``).

    python examples/grpo_minimal.py        # the demo's defaults: 30 steps of 32 prompts x 8 completions

Measured 2026-11-28 on a 2-core AMD EPYC shared with other jobs, the SFT demo model cached: 1 min 52 s at a load
average of 1.6-4 (a step alone takes 0.2 s uncontended), 8 min 54 s at 6-7; held-out exact match 0.7% -> 98.8%,
mean reward 0.27 -> 0.98. Without the cached model, it is trained first (minutes: docs/status.md times the
SFT demo). It moves to CUDA where there is one; the equality is tested on CPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields

import torch

from openpack.config.commands import demo_sft_model
from openpack.config.sections import LaunchConfig
from openpack.core.advantages import sequence_advantages
from openpack.core.batch import PackedBatch, Segment, collate_packed
from openpack.core.logprobs import token_logprobs
from openpack.core.packing import shuffled_epoch
from openpack.core.rl_losses import LOSS_AGG_MODES, PolicyLossParams, policy_terms, token_weights
from openpack.core.schedule import Batching, plan_run, plan_scoring
from openpack.data.demo_task import demo_samples
from openpack.models.loading import load_causal_lm, load_tokenizer
from openpack.models.packed import packed_forward
from openpack.rl.generation import request_seed
from openpack.rl.rewards import exact_match_reward
from openpack.rollout.hf_engine import combined_seed
from openpack.trainers.demo import EVAL_SAMPLES, PROMPT_SAMPLES, accuracy


@dataclass
class Settings:
    """The flags, named as ``openpack train_grpo``'s; defaults are its demo's (data/demo_configs/grpo.yaml)."""

    seed: int = 42
    max_steps: int = 30  # rollout batches
    rollout_batch_size: int = 32  # prompts per rollout batch
    n_samples_per_prompt: int = 8  # completions per prompt: the group whose rewards are compared
    micro_rollout_batch_size: int = 32  # prompts per generate call
    generate_max_len: int = 12
    temperature: float = 1.0
    advantage_estimator: str = "group_norm"  # or dr_grpo, rloo (core/advantages.py)
    loss_agg_mode: str = "token_mean"  # or seq_mean_token_mean, seq_mean_token_sum_norm (core/rl_losses.py)
    eps_clip: float = 0.2
    train_batch_size: int = 256  # completions per optimizer step
    max_tokens_per_gpu: int = 2048  # tokens per packed row
    learning_rate: float = 2e-4
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_epsilon: float = 1e-8
    max_norm: float = 1.0  # gradient clipping
    eval_samples: int = EVAL_SAMPLES  # held-out problems judged before and after; 0: none


def parse(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choices = {"advantage_estimator": ["group_norm", "dr_grpo", "rloo"], "loss_agg_mode": list(LOSS_AGG_MODES)}
    for f in fields(Settings):
        pair = isinstance(f.default, tuple)
        parser.add_argument(f"--{f.name}", type=float if pair else type(f.default), nargs=2 if pair else None,
                            default=f.default, choices=choices.get(f.name))
    s = Settings(**vars(parser.parse_args(argv)))
    if s.rollout_batch_size * s.n_samples_per_prompt % s.train_batch_size:
        parser.error("--train_batch_size must divide --rollout_batch_size x --n_samples_per_prompt")
    return s


@dataclass
class Rollouts:
    """One rollout batch: B = prompts x n completions, prompt-major (completion j of prompt i is i * n + j)."""

    prompts: list[list[int]]  # [B] token ids, each prompt's repeated n times
    completions: list[list[int]]  # [B] sampled token ids, the eos included when it was sampled
    rewards: torch.Tensor  # [B]

    def segment(self, k: int) -> Segment:
        """Completion k as one packed segment: its prompt is context, its tokens are the targets."""
        p, c = self.prompts[k], self.completions[k]
        return Segment(p + c, [False] * len(p) + [True] * len(c), k)

    def lengths(self) -> list[int]:
        """Tokens of each completion (the trained ones)."""
        return [len(c) for c in self.completions]

    def segment_lengths(self) -> list[tuple[int]]:
        """Tokens of each completion's segment, as the planner takes them (one segment per group)."""
        return [(len(p) + len(c),) for p, c in zip(self.prompts, self.completions)]


# ---- sampling: HF generate ----

@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], step: int, s: Settings) -> list[list[int]]:
    """n completions of each prompt, ``micro_rollout_batch_size`` prompts per left-padded ``generate`` call. A
    call is seeded by its prompts' seeds (from --seed, the step and the prompt's place), as the trainer seeds it."""
    model.eval()
    seeds = [request_seed(s.seed, step, i) for i in range(len(prompts))]
    pad, eos, out = tokenizer.pad_token_id, tokenizer.eos_token_id, []
    for lo in range(0, len(prompts), s.micro_rollout_batch_size):
        chunk = prompts[lo:lo + s.micro_rollout_batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        torch.manual_seed(combined_seed(seeds[lo:lo + len(chunk)]))  # (the trainer does it in a forked RNG)
        sequences = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=s.temperature,
                                   top_p=1.0, top_k=0, num_return_sequences=s.n_samples_per_prompt,
                                   max_new_tokens=s.generate_max_len, eos_token_id=[eos], pad_token_id=pad,
                                   use_cache=True)
        for row in sequences[:, width:].tolist():
            out.append(row[:row.index(eos) + 1] if eos in row else row)  # cut after the first eos
    return out


# ---- log-probs of packed rows ----

def completion_logprobs(model, batch: PackedBatch) -> torch.Tensor:
    """log p(token) of every completion token of a packed row, segment by segment: [N] fp32. For a row of two::

        input_ids   p0 p1 c0 c1 c2 | q0 q1 d0 d1      positions restart, attention stays inside a segment
        labels       -  c0 c1 c2 - |  -  d0 d1  -      shifted inside each segment (core/batch.py)
        returned    [log p(c0), log p(c1), log p(c2), log p(d0), log p(d1)]
    """
    hidden = packed_forward(model, batch)  # [T, H], each segment attending to itself only
    per_token = token_logprobs(hidden, model.get_output_embeddings().weight, batch.labels[0])  # [T], chunked head
    return per_token[batch.loss_mask[0]]


@torch.no_grad()
def old_logprobs(model, rollouts: Rollouts, s: Settings) -> list[torch.Tensor]:
    """The policy's log-probs before this batch's updates, per completion: one packed pass, no gradient."""
    model.eval()
    lengths, old = rollouts.lengths(), {}
    for ids in plan_scoring(rollouts.segment_lengths(), 1, s.max_tokens_per_gpu)[0]:  # rows of rank 0 of 1
        batch = collate_packed([rollouts.segment(k) for k in ids]).to(model.device)
        old.update(zip(ids, completion_logprobs(model, batch).split([lengths[k] for k in ids])))
    return [old[k] for k in range(len(lengths))]


# ---- optimizer steps ----

def update(model, optimizer, rollouts: Rollouts, advantages: list[torch.Tensor], old: list[torch.Tensor] | None,
           step: int, s: Settings) -> list[dict]:
    """Optimizer steps of --train_batch_size completions, in a seeded order, each packed into rows of at most
    --max_tokens_per_gpu tokens by the planner every openpack trainer uses. The step's loss is
    ``sum_t w_t loss_t`` over its completion tokens; each row's part is backpropagated as it comes. ``old`` None:
    one step, whose own log-probs, detached, are the old policy's."""
    model.train()
    lengths, rows = rollouts.lengths(), Batching(max_tokens=s.max_tokens_per_gpu)
    planned = plan_run(rollouts.segment_lengths(), [(n,) for n in lengths], 1, rows, s.train_batch_size, 1, None,
                       s.seed + step)[0]  # rank 0 of 1 rank, one epoch, no step limit
    params = PolicyLossParams(eps_low=s.eps_clip, eps_high=s.eps_clip)
    results = []
    for opt_step in planned:
        loss_sum, clipped = 0.0, 0
        for ids in opt_step.micro_batches:
            batch = collate_packed([rollouts.segment(k) for k in ids]).to(model.device)
            logp = completion_logprobs(model, batch)
            old_logp = logp.detach() if old is None else torch.cat([old[k] for k in ids]).to(logp.device)
            terms = policy_terms(logp, old_logp, torch.cat([advantages[k] for k in ids]).to(logp.device), params)
            segment_ids = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([lengths[k] for k in ids]))
            weights = token_weights(segment_ids.to(logp.device), s.loss_agg_mode, opt_step.label_tokens[0],
                                    opt_step.samples, s.generate_max_len)
            loss = (terms.loss * weights).sum()
            loss.backward()
            loss_sum, clipped = loss_sum + loss.item(), clipped + int(terms.clipped.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_norm)  # the norm before clipping
        optimizer.step()
        optimizer.zero_grad()
        results.append({"loss": loss_sum, "grad_norm": grad_norm.item(),
                        "clip_ratio": clipped / opt_step.label_tokens[0]})
    return results


# ---- the loop ----

def held_out(model, tokenizer, when: str, s: Settings) -> None:
    """Greedy answers to --eval_samples held-out problems: the share that is the bare right sum."""
    if s.eval_samples:
        rate = accuracy(model, tokenizer, s.eval_samples)["eval_bare_answer"]
        print(f"held-out {when} training: exact match {rate:.1%} of {s.eval_samples} problems (greedy)")


def main(argv: list[str] | None = None) -> list[dict]:
    """Train the demo with ``argv``'s flags; returns each rollout batch's metrics (the trainer's names)."""
    s = parse(argv)
    torch.manual_seed(s.seed)
    path = str(demo_sft_model(LaunchConfig(launcher="local"), s.seed))
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path).to("cuda" if torch.cuda.is_available() else "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, betas=tuple(s.adam_betas),
                                  eps=s.adam_epsilon, weight_decay=0.0)
    rows = demo_samples("train", PROMPT_SAMPLES)  # {"prompt": "07+35=", "response": "42"}
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    order = shuffled_epoch(len(rows), s.seed, 0)  # the prompts' order, cut into rollout batches
    n, B = s.n_samples_per_prompt, s.rollout_batch_size
    held_out(model, tokenizer, "before", s)
    history = []
    for step in range(s.max_steps):
        start = time.perf_counter()
        # ---- generate ----
        batch_ids = order[step * B:(step + 1) * B]
        completions = generate(model, tokenizer, [prompts[i] for i in batch_ids], step, s)
        # ---- reward ----
        batch_rows = [rows[i] for i in batch_ids for _ in range(n)]
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = torch.tensor(exact_match_reward([r["prompt"] for r in batch_rows], texts, batch_rows))
        rollouts = Rollouts([prompts[i] for i in batch_ids for _ in range(n)], completions, rewards)
        # ---- advantages ----
        # group_norm: (r - mean of its group) / (std of its group + 1e-6), one scalar per completion, given to
        # every token of it (with no KL penalty and gamma 1, the return of each token is the final reward's)
        scalars = sequence_advantages(rewards, n, s.advantage_estimator)
        advantages = [scalars[k].repeat(length) for k, length in enumerate(rollouts.lengths())]
        # ---- update ----
        # the ratio's denominator is the policy before this batch's updates: with one optimizer step per batch,
        # that step's own log-probs, detached (TRL's num_iterations=1); with more, a pass of its own first
        old = old_logprobs(model, rollouts, s) if B * n > s.train_batch_size else None
        steps = update(model, optimizer, rollouts, advantages, old, step, s)
        # ---- log ----
        metrics = {key: sum(r[key] for r in steps) / len(steps) for key in steps[0]}  # mean over optimizer steps
        metrics.update(step=step + 1, reward=rewards.mean().item(), optimizer_steps=len(steps),
                       response_length=sum(rollouts.lengths()) / len(completions),
                       step_time_s=time.perf_counter() - start)
        history.append(metrics)
        print(f"step {step + 1}/{s.max_steps}  reward {metrics['reward']:.3f}  loss {metrics['loss']:.4f}  "
              f"grad_norm {metrics['grad_norm']:.4f}  clip_ratio {metrics['clip_ratio']:.4f}  "
              f"length {metrics['response_length']:.1f}  {metrics['step_time_s']:.1f} s", flush=True)
    held_out(model, tokenizer, "after", s)
    return history


if __name__ == "__main__":
    main()
