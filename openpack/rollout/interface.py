"""The rollout engine interface: what an engine takes and returns, what it must answer, and how it fails.

Both backends (``vllm_engine.VLLMEngine``, ``hf_engine.HFEngine``) implement ``Engine`` and speak these types,
so the trainer never knows which one generated; ``engine_group.EngineGroup`` drives one or many of them, local
or as Ray actors. Log-probs are always of the model's raw distribution (temperature 1, no top-p), because the
trainer scores tokens at temperature 1: a behaviour log-prob taken after temperature or top-p would make the
trainer/engine ratio differ from 1 even with identical weights.

Every other rollout module imports this one; it imports none of them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Protocol

import torch

DEFAULT_BUCKET_BYTES = 256 * 1024**2  # weights per update call: whole layers up to this size (buckets.py)
# the calls that land weights while a generation is under way (--partial_rollout): they run beside it, not after it
IN_FLIGHT_CALLS = ("pause_generation", "update_weights", "receive_weights", "resume_generation")


@dataclass
class SamplingConfig:
    """How completions are sampled; ``temperature=0`` is greedy (then ``n`` must be 1)."""

    n: int = 1  # completions per prompt (--n_samples_per_prompt)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64  # --generate_max_len
    stop_token_ids: list[int] = field(default_factory=list)  # eos etc.
    max_total: int | None = None  # --max_len: prompt + completion tokens at most (None: no shared budget)

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

    def budget(self, prompt_tokens: int) -> int:
        """Most tokens a completion of a prompt of ``prompt_tokens`` tokens may have: ``max_tokens``, or what the
        prompt leaves of ``max_total`` if less (at least 1, as OpenRLHF's ``max(1, max_len - prompt_len)``)."""
        if self.max_total is None:
            return self.max_tokens
        return max(1, min(self.max_tokens, self.max_total - prompt_tokens))


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    ``tokens``: the sampled tokens, the stop/eos token included if it was sampled.
    ``logprobs``: log p(tokens[t] | prompt, tokens[:t]) under the raw model (temperature 1), same length.
    ``finished``: True when it ended on a stop token; False when cut at ``max_tokens``.
    ``versions``: the policy version whose weights sampled each token, where the engine's weights were labelled
    (``Engine.resume_generation``, ``--partial_rollout``); None for a token sampled before any label (the weights
    the request started with). The list itself is None where no token was sampled by labelled weights.
    """

    tokens: list[int]
    logprobs: list[float]
    finished: bool
    versions: list[int | None] | None = None


class Engine(Protocol):
    """What the trainer calls on a rollout engine (directly, or on a Ray actor of it through ``EngineGroup``)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Completion]]:
        """``sampling.n`` completions per token-id prompt, each sampled with its own seed."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Raw log-probs of each sequence's tokens 1.. under the engine's current weights."""

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load whole layers' HF-named tensors in place (one bucket of ``buckets.layer_buckets``)."""

    def pause_generation(self) -> None:
        """Stop sampling at the end of the step under way, keeping the requests under way, so that weights can land
        (``--partial_rollout``); ``update_weights`` calls may then come."""

    def resume_generation(self, version: int) -> None:
        """Label the weights now held policy ``version`` and sample on: the requests kept continue under them."""

    def sleep(self) -> None:
        """Free weights and KV cache for a colocated trainer (``rl/colocation.py``)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back "weights", "kv_cache" or both (None)."""

    def node_and_pid(self) -> str:
        """``process_location()`` of the process the engine runs in, so a dead one can be named."""


class EngineDiedError(RuntimeError):
    """A rollout engine's actor died (crash, OOM kill, node loss)."""


class EngineStartError(RuntimeError):
    """A rollout engine could not start (vLLM refused the model or the options): one line with vLLM's reason."""


def engine_start_error(model_path: str, reason: str, log_file=None) -> EngineStartError:
    """The line a user reads when vLLM cannot start ``model_path``; ``reason`` is vLLM's own, one line;
    ``log_file`` holds what vLLM printed while it tried."""
    log = f" (vLLM's output: {log_file})" if log_file else ""
    return EngineStartError(f"vLLM could not start an engine for {model_path}: {reason}{log}. Generate with "
                            "--rollout_backend hf (the policy itself), or use a model vLLM can serve")


def one_line(error: BaseException, limit: int = 400) -> str:
    """'TypeName: message' on one line (a multi-line message, e.g. pydantic's, joined by '; '), at most ``limit``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information")]  # pydantic's link line
    text = f"{type(error).__name__}: {'; '.join(lines)}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def last_error_line(text: str) -> str:
    """The last 'SomeError: message' line of a traceback's text (Ray puts a creation task's traceback in its
    error), else the last non-empty line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        name = line.split(":", 1)[0]
        if name.endswith(("Error", "Exception")) and " " not in name:
            return line
    return lines[-1] if lines else "no reason given"


def process_location() -> str:
    """'<host> pid <pid>' of the calling process; engines report it so a dead one can be named."""
    return f"{socket.gethostname()} pid {os.getpid()}"
