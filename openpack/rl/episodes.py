"""The rollout batch: prompts x n completions as token ids, with behaviour log-probs, rewards and versions.

A completion is one packed segment (``Rollouts.segments``): the prompt's tokens are context, the completion's
are the targets, so a packed row of completions costs no compute on padding. A multi-turn episode
(``rl/agents``) is a completion whose tokens mix sampled ids (targets) and the environment's observations
(context): its ``targets`` mask has holes, and its per-token lists (behaviour, log-probs, advantages) cover the
targets only. Every rank holds the whole batch
(token ids and a few floats per token, small next to a model): each rank can then plan the same packs and
compute the same advantages without another exchange (``shared_rollouts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from openpack.core.batch import PROMPT, SAMPLE, Segment
from openpack.distributed.process import DistInfo, all_gather_objects, broadcast_object


@dataclass
class Rollouts:
    """The rollout batch: B = prompts x n completions, prompt-major (completion j of prompt i is i * n + j)."""

    prompt_tokens: list[list[int]]  # [B]
    completion_tokens: list[list[int]]
    behaviour: list[list[float]]  # the engine's log-prob of each completion token
    finished: list[bool]
    rewards: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # a reward file's own ``scores`` (OpenRLHF's), what
    # --dynamic_filtering tests (empty: the rewards)
    reward_logs: list[dict[str, float]] = field(default_factory=list)  # a reward file's ``extra_logs`` of each sample
    versions: list[int] = field(default_factory=list)  # the policy version (weight syncs so far) that sampled each
    # sample's first token (its oldest: a partial rollout's later tokens may be newer)
    token_versions: list[list[int]] = field(default_factory=list)  # [B][trained tokens] the version that sampled
    # each, like ``behaviour`` (empty: every token of sample k by versions[k])
    # multi-turn episodes only (empty otherwise):
    targets: list[list[bool]] = field(default_factory=list)  # [B][len(completion)] True: sampled, trained
    env_rewards: list[float] = field(default_factory=list)  # the environment's reward of each episode (its turns')
    turn_credit: list[list[float]] = field(default_factory=list)  # [B][targets] each turn's reward at its last

    @property
    def size(self) -> int:
        """B, the completions (or episodes) in the batch."""
        return len(self.prompt_tokens)

    def target_mask(self, k: int) -> list[bool]:
        """Which completion tokens of sample ``k`` are trained: all, or an episode's sampled ones."""
        return self.targets[k] if self.targets else [True] * len(self.completion_tokens[k])

    def segments(self, k: int) -> list[Segment]:
        prompt = self.prompt_tokens[k]
        return [Segment(prompt + self.completion_tokens[k], [False] * len(prompt) + self.target_mask(k), k)]

    def lengths(self) -> list[tuple[int]]:
        return [(len(p) + len(c),) for p, c in zip(self.prompt_tokens, self.completion_tokens)]

    def response_lengths(self) -> list[int]:
        """Trained tokens of each sample (an episode's sampled tokens, not its observations)."""
        if self.targets:
            return [sum(mask) for mask in self.targets]
        return [len(c) for c in self.completion_tokens]

    def sampled_by(self, k: int) -> list[int]:
        """The policy version that sampled each trained token of sample ``k`` (``--partial_rollout``: several)."""
        return self.token_versions[k] if self.token_versions else [self.versions[k]] * len(self.behaviour[k])

    def select(self, indices) -> "Rollouts":
        """The samples at ``indices``, in that order (rewards too, once set)."""
        indices = list(indices)
        return Rollouts(**{f.name: [getattr(self, f.name)[k] for k in indices] if getattr(self, f.name) else []
                           for f in fields(self)})

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        return Rollouts(**{f.name: [x for part in parts for x in getattr(part, f.name)] for f in fields(Rollouts)})


@dataclass
class Units:
    """How completions of a rollout batch are laid out in the training-side passes (policy, old policy,
    reference, critic): unit u is ``members[u]``, completion ids in the order their tokens sit in a batch.

    Unshared (``--no_prefix_sharing``, or rows not packed under the token cap): one completion a unit, prompt +
    completion as one segment. Shared (``--prefix_sharing``, the default under --packing_samples
    --use_dynamic_batch): a unit is a prompt and completions of it, prompt | completion | ... | completion, each
    completion attending to the prompt and itself and continuing the prompt's positions (``core/batch.py``), so
    the prompt is computed once per unit instead of once per completion. ``add`` lays out a set of completions
    (a step's, or the whole batch for a scoring pass): completions of one prompt (group k // n of a prompt-major
    batch) go together, and a group whose shared row would pass the token cap is split into units of as many
    completions as fit, each with its own copy of the prompt (``split_groups`` counts such splits).
    """

    rollouts: Rollouts
    shared: bool
    n: int = 1  # completions per prompt
    max_tokens: int | None = None  # the row cap a shared unit must fit
    members: list[list[int]] = field(default_factory=list)
    lengths: list[tuple[int, ...]] = field(default_factory=list)  # each unit's segment lengths
    split_groups: int = 0

    def __post_init__(self):
        if not self.shared:  # unit k is completion k
            self.members = [[k] for k in range(len(self.rollouts.prompt_tokens))]
            self.lengths = self.rollouts.lengths()

    def add(self, completions) -> list[int]:
        """The units of ``completions`` (ids, in order), laid out as new units when shared; returns their ids."""
        if not self.shared:
            return list(completions)
        groups: dict[int, list[int]] = {}
        for k in completions:
            groups.setdefault(k // self.n, []).append(k)
        parts = [part for group in groups.values() for part in self._split(group)]
        first = len(self.members)
        for part in parts:
            self.members.append(part)
            self.lengths.append(tuple(len(s.tokens) for s in self.segments(len(self.members) - 1)))
        return list(range(first, len(self.members)))

    def _split(self, group: list[int]) -> list[list[int]]:
        prompt = self.rollouts.prompt_tokens[group[0]]
        same = [k for k in group if self.rollouts.prompt_tokens[k] == prompt]
        if len(same) < len(group):  # episodes whose environment opened them differently: one unit per opening
            rest = [k for k in group if k not in same]
            return self._split(same) + self._split(rest)
        parts, tokens = [[]], len(prompt)
        for k in group:
            size = len(self.rollouts.completion_tokens[k])
            if not size:
                raise ValueError(f"--prefix_sharing: completion {k} has no tokens to follow its prompt with")
            if parts[-1] and self.max_tokens is not None and tokens + size > self.max_tokens:
                parts.append([])
                tokens = len(prompt)
            parts[-1].append(k)
            tokens += size
        self.split_groups += len(parts) > 1
        return parts

    def segments(self, u: int) -> list[Segment]:
        if not self.shared:
            return self.rollouts.segments(self.members[u][0])
        prompt = self.rollouts.prompt_tokens[self.members[u][0]]
        return [Segment(prompt, [False] * len(prompt), u, PROMPT),
                *(Segment(self.rollouts.completion_tokens[k], self.rollouts.target_mask(k), u, SAMPLE,
                          after_prompt=True) for k in self.members[u])]

    def completions(self, ids) -> list[int]:
        """The completions of units ``ids``, in the order their tokens sit in a batch of those units."""
        return [k for u in ids for k in self.members[u]]


def sampling_versions(labels: list[int | None] | None, length: int, asked: int) -> list[int]:
    """The policy version that sampled each of ``length`` tokens, from an engine's labels (``Completion.versions``,
    where a weight update landed while they were sampled: ``--partial_rollout``); a token without one was sampled
    by the weights the batch was asked with, policy version ``asked`` (in order: ``InOrder``, Ray's call order)."""
    if labels is None:
        return [asked] * length
    return [asked if v is None else v for v in labels]


def shared_rollouts(local: Rollouts | None, dist: DistInfo, generated_on_all_ranks: bool) -> Rollouts:
    """The whole rollout batch on every rank: every rank's share gathered in prompt order (HF), or rank 0's
    (vLLM engines) broadcast."""
    if not generated_on_all_ranks:
        return broadcast_object(local)
    return Rollouts.concat(all_gather_objects(local))


def rollout_metrics(rollouts: Rollouts) -> dict:
    """Reward and response-length statistics of a rollout batch (TRL's and OpenRLHF's names), and the means of
    what a reward file reported beside its rewards: ``reward/score``, ``reward/extra/<name>`` (each over the samples
    that reported it, as OpenRLHF logs its ``extra_logs``)."""
    rewards = torch.tensor(rollouts.rewards, dtype=torch.float64)
    lengths = torch.tensor(rollouts.response_lengths(), dtype=torch.float64)
    metrics = {"reward": rewards.mean().item(), "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
               "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
               "response_length/truncated": 1.0 - sum(rollouts.finished) / len(rollouts.finished)}
    if rollouts.scores:
        metrics["reward/score"] = sum(rollouts.scores) / len(rollouts.scores)
    for name in sorted({name for logs in rollouts.reward_logs for name in logs}):
        values = [logs[name] for logs in rollouts.reward_logs if name in logs]
        metrics[f"reward/extra/{name}"] = sum(values) / len(values)
    return metrics
