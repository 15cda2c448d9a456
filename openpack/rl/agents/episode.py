"""One multi-turn episode as token ids: what the engine sampled, what the environment answered, what is trained.

Token in, token out: the ids of an action are the ids the engine sampled, never its text encoded again, and an
observation is appended as the ids of its own text (or of its chat-template delta, ``agents.chat``). The episode
is one packed segment after its first observation: the sampled tokens are the targets, observations are context,
so its loss mask has holes::

    first observation | action 1        | observation 2 | action 2     | ...
    context           | targets         | context       | targets
    behaviour: -      | engine log-prob | 0.0 (unused)  | engine log-p |

A per-turn reward is credited to the turn's last sampled token (``turn_ends``); the episode's reward is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Episode:
    """An episode under way or ended. ``tokens``, ``targets`` and ``behaviour`` cover everything after the first
    observation (``prompt``), one entry per token."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    targets: list[bool] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # each token's sampling version where the engine
    # labelled it (--partial_rollout), else None (an observation, or the weights the batch was asked with)
    turn_ends: list[int] = field(default_factory=list)  # index in ``tokens`` of each turn's last sampled token
    turn_rewards: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's extra metrics, last turn's
    finished: bool = False  # the environment said done (else a limit ended it)
    stop: str = ""  # what ended it: "done", "max_turns", "token_budget", "error: ...", "timeout: ..."

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def length(self) -> int:
        """Tokens of the whole episode, first observation included."""
        return len(self.prompt) + len(self.tokens)

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def failed(self) -> bool:
        """The environment raised or timed out: the episode is counted and left out of the update."""
        return self.stop.startswith(("error", "timeout"))

    @property
    def sampled_tokens(self) -> int:
        return sum(self.targets)

    def add_action(self, ids: list[int], logprobs: list[float], versions: list[int | None] | None = None) -> None:
        """The engine's sampled ids and their behaviour log-probs (and sampling versions): the turn's targets."""
        if len(ids) != len(logprobs):
            raise ValueError(f"an action of {len(ids)} tokens came with {len(logprobs)} log-probs")
        if not ids:
            raise ValueError("an action with no tokens: the engine sampled nothing")
        self.tokens += ids
        self.targets += [True] * len(ids)
        self.behaviour += list(logprobs)
        self.versions += list(versions) if versions is not None else [None] * len(ids)
        self.turn_ends.append(len(self.tokens) - 1)
        self.turn_rewards.append(0.0)

    def credit(self, reward: float) -> None:
        """The environment's reward for the last action, on its last sampled token."""
        if not self.turn_ends:
            raise ValueError("a reward before any action")
        self.turn_rewards[-1] += float(reward)

    def add_observation(self, ids: list[int]) -> None:
        """The environment's answer: context, never a target."""
        self.tokens += ids
        self.targets += [False] * len(ids)
        self.behaviour += [0.0] * len(ids)
        self.versions += [None] * len(ids)

    def token_rewards(self) -> list[float]:
        """[len(tokens)] each turn's reward on its last sampled token, 0 elsewhere (per-turn credit)."""
        rewards = [0.0] * len(self.tokens)
        for end, reward in zip(self.turn_ends, self.turn_rewards):
            rewards[end] += reward
        return rewards
