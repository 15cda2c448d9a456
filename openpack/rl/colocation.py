"""``--colocate_all_models``: vLLM and the DeepSpeed ranks take turns on the same devices, one step at a time.

Training holds the device while vLLM sleeps (its KV cache freed, its weights offloaded to host memory);
around each generation the two swap, in this order (rank 0 drives the engines, every rank its own
DeepSpeed states)::

    rank 0        wake engines' weights         |                 wake KV cache   generate   sleep engines  |
    every rank                  push weights    offload DS states |                                         | reload DS states
                                (collective)                   barrier                                   barrier

- The push comes after the wake: a woken engine holds the weights it slept with (sleep level 1) or none
  (level 2), and a push into a sleeping engine is lost. TRL shipped exactly that (huggingface/trl#5312:
  after a wake, generation reloaded the base weights over the synced ones). So a colocated run pushes before
  every generation instead of after every update, and an engine refuses a push while asleep
  (``VLLMEngine.update_weights``). Waking weights first and the KV cache after the push is the order vLLM's
  sleep-mode docs give for RLHF.
- The push comes before the DeepSpeed offload: it reads the trainer's parameters where they live (gathered one
  at a time under ZeRO-3, or broadcast from GPU memory by ``--vllm_sync_backend nccl``). The engine's weights
  are small next to the DeepSpeed states (2 bytes a parameter in bf16 against 16 for parameters, gradients and
  Adam's moments), so both fit for that moment; the KV cache, the large part, is only woken after the offload.
- The barriers keep engine i's KV cache off GPU i until rank i's states have left it, and rank i's states off
  it until the engines sleep (engine i shares rank i's bundle; ``ray_launcher``).

DeepSpeed's ``offload_states`` / ``reload_states`` (0.19) move the ZeRO 1-3 optimizer's parameters, gradients
and Adam states to host memory and back; they refuse ZeRO-0 (no ZeRO optimizer) and ``--param_offload``, and
on a CPU-only machine there is nothing to move. In those cases the states stay where they are (said once in
the log). vLLM's sleep is a no-op on CPU too, so on CI machines only the order of the calls is real, and the
tests check that order and that the pushed weights are the ones vLLM scores with.
"""

from __future__ import annotations

import logging
import time

from openpack.distributed.process import barrier

logger = logging.getLogger("openpack")


def can_offload(engine) -> bool:
    """Whether DeepSpeed 0.19's ``offload_states`` can move this engine's states off its GPU."""
    if engine.device.type != "cuda" or engine.zero_optimization_stage() == 0:
        return False
    return engine.zero_offload_param() is None or engine.zero_offload_param().device == "none"


class Colocation:
    """Context manager around one generation: ``with colocation: rollouts = ...``.

    ``engines``: the EngineGroup (driven by rank 0 only; None on ranks without one); ``trainers``: the DeepSpeed
    engines with optimizer states (policy, critic); ``push``: sends the current policy weights to the engines
    and returns the seconds it took (collective: every rank calls it). ``push_s`` is the last push's time.
    """

    def __init__(self, engines, trainers: list, push, is_main: bool):
        self.engines = engines if is_main else None
        trainers = [t for t in trainers if t is not None]
        self.trainers = [t for t in trainers if can_offload(t)]
        self.push, self.push_s = push, 0.0
        if is_main and len(self.trainers) < len(trainers):
            logger.info("colocation: DeepSpeed states stay on the device while vLLM generates (offload_states needs "
                        "a GPU and ZeRO 1-3 without --param_offload)")
        if self.engines is not None:
            self.engines.sleep()  # until the first generation (under Ray the driver already put them to sleep)

    def __enter__(self) -> Colocation:
        if self.engines is not None:
            self.engines.wake_up(["weights"])
        self.push_s = self.push()
        for trainer in self.trainers:
            trainer.offload_states()
        barrier()
        if self.engines is not None:
            self.engines.wake_up(["kv_cache"])
        return self

    def metrics(self) -> dict[str, float]:
        """The last push, made at the engines' wake: the step's weight sync."""
        return {"time/weight_sync": self.push_s}

    def __exit__(self, *exc) -> None:
        if self.engines is not None:
            self.engines.sleep()
        barrier()
        start = time.perf_counter()
        for trainer in self.trainers:
            trainer.reload_states()
        if self.trainers:
            logger.debug("colocation: DeepSpeed states reloaded in %.2f s", time.perf_counter() - start)
