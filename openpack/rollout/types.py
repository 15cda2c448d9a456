"""What a rollout engine takes and returns: sampling settings and one sampled completion.

Both backends (``VLLMEngine``, ``HFEngine``) speak these types, so the trainer never knows which one
generated. Log-probs are always of the model's raw distribution (temperature 1, no top-p), because the
trainer scores tokens at temperature 1: a behaviour log-prob taken after temperature or top-p would make
the trainer/engine ratio differ from 1 even with identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingConfig:
    """How completions are sampled; ``temperature=0`` is greedy (then ``n`` must be 1)."""

    n: int = 1  # completions per prompt (--n_samples_per_prompt)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64  # --generate_max_len
    stop_token_ids: list[int] = field(default_factory=list)  # eos etc.

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"--n_samples_per_prompt must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"--generate_max_len must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"--temperature 0 is greedy: n_samples_per_prompt={self.n} would repeat one completion")


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    ``tokens``: the sampled tokens, the stop/eos token included if it was sampled.
    ``logprobs``: log p(tokens[t] | prompt, tokens[:t]) under the raw model (temperature 1), same length.
    ``finished``: True when it ended on a stop token; False when cut at ``max_tokens``.
    """

    tokens: list[int]
    logprobs: list[float]
    finished: bool
