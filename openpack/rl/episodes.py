"""The rollout batch: prompts x n completions as token ids, with behaviour log-probs, rewards and versions.

A completion is one packed segment (``Rollouts.segments``): the prompt's tokens are context, the completion's
are the targets, so a packed row of completions costs no compute on padding. Every rank holds the whole batch
(token ids and a few floats per token, small next to a model): each rank can then plan the same packs and
compute the same advantages without another exchange (``shared_rollouts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from openpack.core.batch import Segment
from openpack.distributed.process import DistInfo, all_gather_objects, broadcast_object


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


def shared_rollouts(local: Rollouts | None, dist: DistInfo, generated_on_all_ranks: bool) -> Rollouts:
    """The whole rollout batch on every rank: every rank's share gathered in prompt order (HF), or rank 0's
    (vLLM engines) broadcast."""
    if not generated_on_all_ranks:
        return broadcast_object(local)
    parts = all_gather_objects(local)
    return Rollouts(**{name: [x for part in parts for x in getattr(part, name)] for name in
                       ("prompt_tokens", "completion_tokens", "behaviour", "finished", "versions")})


def rollout_metrics(rollouts: Rollouts, generation_s: float) -> dict:
    """Reward and response-length statistics of a rollout batch (TRL's and OpenRLHF's names)."""
    rewards = torch.tensor(rollouts.rewards, dtype=torch.float64)
    lengths = torch.tensor(rollouts.response_lengths(), dtype=torch.float64)
    return {"reward": rewards.mean().item(), "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response_length/truncated": 1.0 - sum(rollouts.finished) / len(rollouts.finished),
            "generation_tokens_per_s": lengths.sum().item() / max(generation_s, 1e-9),
            "time/generation": generation_s}
