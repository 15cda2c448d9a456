"""A group of rollout engines seen as one: prompts sharded across them, weights sent to all of them.

Engines are local objects (``VLLMEngine``/``HFEngine`` in this process) or Ray actor handles of them
(``remote=True``); the trainer calls the group the same way either way. Remote calls are plain ``ray.get``:
a dead actor becomes ``EngineDiedError`` naming the engine and where it ran, so the driver can exit with a
message instead of a Ray traceback.

With ``in_flight`` (``--partial_rollout``), the calls that land weights (``IN_FLIGHT_CALLS``) skip the queue: a Ray
actor runs them in a concurrency group of their own (``WEIGHTS_GROUP``, ordered among themselves), beside the
generation under way, which ``pause_generation`` holds between two sampling steps (``vllm_engine.StepGate``).

Sharding is contiguous with near-equal counts (engine i gets prompts [start_i, start_i + size_i)): results
concatenate back in prompt order with no index bookkeeping. Balancing by token counts would matter only for
very mixed prompt lengths; vLLM's continuous batching already evens out most of it inside an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from openpack.rollout.buckets import layer_buckets, standalone
from openpack.rollout.interface import (DEFAULT_BUCKET_BYTES, IN_FLIGHT_CALLS, Completion, EngineDiedError,
                                        SamplingConfig)

WEIGHTS_GROUP = "weights"  # the Ray concurrency group of in-flight weight updates


def engine_actor_options(in_flight: bool) -> dict:
    """The ``ray.remote`` options an engine actor class needs: with ``in_flight``, a concurrency group of one thread
    for ``IN_FLIGHT_CALLS`` (Ray takes concurrency groups only there, not in ``.options``)."""
    return {"concurrency_groups": {WEIGHTS_GROUP: 1}} if in_flight else {}


def vllm_engine_actor_class(in_flight: bool = False, **actor_options):
    """``ray.remote(VLLMEngine)`` with ``actor_options`` (e.g. ``num_cpus=1`` on CPU, ``num_gpus=1``).

    Create actors with ``cls.options(scheduling_strategy=...).remote(model_path, seed=...)``; the engine sets
    vLLM's CPU variables in its ``__init__``, inside the actor, before importing vLLM. ``max_concurrency`` is
    left at 1: an engine serves one call at a time, so calls from one driver run in order (with ``in_flight``,
    weight updates run beside them: ``EngineGroup``).
    """
    import ray

    from openpack.rollout.vllm_engine import VLLMEngine

    options = {**engine_actor_options(in_flight), **actor_options}
    return ray.remote(**options)(VLLMEngine) if options else ray.remote(VLLMEngine)


def shard_sizes(total: int, parts: int) -> list[int]:
    """Near-equal contiguous shard sizes: shard_sizes(10, 3) == [4, 3, 3]."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def split_contiguous(items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` contiguous runs of near-equal length (some may be empty)."""
    runs, start = [], 0
    for size in shard_sizes(len(items), parts):
        runs.append(items[start:start + size])
        start += size
    return runs


class EngineGroup:
    """``engines``: local engine objects, or Ray actor handles of them when ``remote`` is True (made by
    ``vllm_engine_actor_class(in_flight)`` with the same ``in_flight``)."""

    def __init__(self, engines: list, remote: bool, in_flight: bool = False):
        if not engines:
            raise ValueError("EngineGroup needs at least one engine (--vllm_num_engines >= 1)")
        self.engines = list(engines)
        self.remote = remote
        self.in_flight = in_flight
        self.object_store_bytes = 0  # put into Ray's object store by this group so far (remote engines)
        self._where: list[str | None] = [None] * len(self.engines)
        if remote:
            self._where = self._call_all("node_and_pid", [()] * len(self.engines))

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Completion]]:
        """Each engine generates for its contiguous shard; results in prompt order."""
        return self.start_generate(prompts, sampling, seeds)()

    def start_generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                       seeds: list[int]) -> Callable[[], list[list[Completion]]]:
        """``generate`` begun now; the returned function waits for its results. Remote engines work meanwhile, and
        since an actor runs its calls in order, weights sent after this call reach an engine after these
        completions (asynchronous training relies on it). Local engines generate when the function is called."""
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
        shards = list(zip(split_contiguous(prompts, self.num_engines), split_contiguous(seeds, self.num_engines)))
        return self._start_sharded("generate", [(p, sampling, s) for p, s in shards])

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Raw log-probs of each sequence's tokens 1.. (see ``VLLMEngine.score``), sharded like ``generate``."""
        return self._sharded("score", [(shard,) for shard in split_contiguous(sequences, self.num_engines)])

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Send HF-named weights to every engine, one whole-layer bucket at a time; returns the bucket count.

        To remote engines each tensor goes as a copy of its own elements (``standalone``): pickling a view writes
        its whole storage, and under ZeRO-2 every parameter is a view into one flat buffer.
        """
        count = 0
        for bucket in layer_buckets(weights, bucket_bytes):
            if self.remote:
                bucket = [(name, standalone(tensor)) for name, tensor in bucket]
            self.broadcast_call("update_weights", bucket)
            count += 1
        return count

    def check_weight_names(self, names: list[str]) -> list[tuple[list[str], list[str]]]:
        """Each engine's (weights it holds that ``names`` never reach, names it has no weight for)."""
        return self.broadcast_call("check_weight_names", names)

    def pause_generation(self) -> None:
        """Every engine stops sampling after its step under way, its requests kept, until ``resume_generation``."""
        self.broadcast_call("pause_generation")

    def resume_generation(self, version: int) -> None:
        """Every engine labels the weights it now holds policy ``version`` and samples on with them."""
        self.broadcast_call("resume_generation", version)

    def sleep(self) -> None:
        self.broadcast_call("sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``tags``: vLLM's "weights" or "kv_cache" (None: both); see ``rl/colocation.py`` for the order."""
        self.broadcast_call("wake_up", tags)

    def broadcast_call(self, method: str, *args) -> list:
        """``engine.method(*args)`` on every engine (the arguments put in Ray's object store once, their size
        added to ``object_store_bytes``)."""
        if self.remote and args:
            import ray

            args = tuple(ray.put(a) for a in args)
            sizes = ray.experimental.get_object_locations(list(args))
            self.object_store_bytes += sum(sizes[ref]["object_size"] or 0 for ref in args)
        return self._call_all(method, [args] * self.num_engines)

    def submit(self, method: str, *args) -> list:
        """Start ``method`` on every remote engine without waiting; pass the result to ``wait`` (NcclSync)."""
        if not self.remote:
            raise RuntimeError(f"EngineGroup.submit({method!r}) needs Ray actor engines (remote=True)")
        return [self._remote(engine, method).remote(*args) for engine in self.engines]

    def wait(self, refs: list, indices: list[int] | None = None) -> list:
        """The results of remote calls (``refs[k]`` on engine ``indices[k]``), or EngineDiedError naming the engine."""
        import ray

        results = []
        for index, ref in zip(range(len(refs)) if indices is None else indices, refs):
            try:
                results.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
                raise self._died(index, error) from error
        return results

    def _sharded(self, method: str, per_engine_args: list[tuple]) -> list:
        return self._start_sharded(method, per_engine_args)()

    def _start_sharded(self, method: str, per_engine_args: list[tuple]) -> Callable[[], list]:
        busy = [i for i, args in enumerate(per_engine_args) if args[0]]  # engines with an empty shard sit out
        args = [per_engine_args[i] for i in busy]
        if self.remote:
            refs = [self._remote(self.engines[i], method).remote(*a) for i, a in zip(busy, args)]
            return lambda: [item for shard in self.wait(refs, busy) for item in shard]
        return lambda: [item for shard in self._call_all(method, args, busy) for item in shard]

    def _call_all(self, method: str, per_engine_args: list[tuple], indices: list[int] | None = None) -> list:
        indices = list(range(self.num_engines)) if indices is None else indices
        if not self.remote:
            return [getattr(self.engines[i], method)(*args) for i, args in zip(indices, per_engine_args)]
        refs = [self._remote(self.engines[i], method).remote(*args) for i, args in zip(indices, per_engine_args)]
        return self.wait(refs, indices)

    def _remote(self, actor, method: str):
        """The actor's ``method``, in the weights' concurrency group where it lands weights in flight."""
        call = getattr(actor, method)
        return call.options(concurrency_group=WEIGHTS_GROUP) if self.in_flight and method in IN_FLIGHT_CALLS else call

    def _died(self, index: int, error: Exception) -> EngineDiedError:
        where = f" on {self._where[index]}" if self._where[index] else ""
        first_line = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        return EngineDiedError(
            f"vLLM engine {index} of {self.num_engines}{where} died: {first_line}. Its log is in the Ray session "
            "logs (/tmp/ray/session_latest/logs); out of memory is the usual cause: lower "
            "--vllm_gpu_memory_utilization or --generate_max_len"
        )
