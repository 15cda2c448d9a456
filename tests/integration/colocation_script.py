"""Run by test_colocation.py in its own process (an in-process vLLM engine ends torch.distributed's default group).

A real DeepSpeed engine (ZeRO-2, one gloo rank) trains one step; a real in-process vLLM engine, built with sleep
mode and wrapped to record its calls, sleeps through it; then one ``Colocation`` turn wakes it, pushes, and it
scores fixed sequences. DeepSpeed's offload/reload run for real (``can_offload`` is forced on: on CPU the run
skips them, but they work here) and are recorded too. Prints one JSON line: the calls in order, vLLM's log-probs
against the trainer's after the turn, how far the step moved the trainer's, and what a push into a sleeping
engine does.
"""

import json
import sys

import torch

from rollout_models import PROMPTS, save_demo_policy

from openpack.core.batch import Segment, collate_packed
from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine
from openpack.distributed.process import init_distributed
from openpack.models.packed import PackedCausalLM
from openpack.rollout.engine_group import EngineGroup
from openpack.rollout.vllm_engine import VLLMEngine
from openpack.rollout.weight_sync import InHostSync, policy_weights
from openpack.rl import colocation

OPTIM = OptimConfig(5e-2, 0.0, (0.9, 0.95), "constant", 0, 10, 0.1, 100.0)
SEQUENCES = [p + [(7 * i + 3 * t) % 40 + 4 for t in range(10)] for i, p in enumerate(PROMPTS)]
CALLS = []


class Recording:
    """Forwards every call to ``target`` and records its name (and wake_up's tags) in CALLS."""

    def __init__(self, target, name: str):
        self.target, self.name = target, name

    def __getattr__(self, method):
        real = getattr(self.target, method)

        def call(*args, **kwargs):
            CALLS.append(f"{self.name}.{method}" + (f"{args[0]}" if method == "wake_up" and args else ""))
            return real(*args, **kwargs)
        return call


def batch_of(sequences):
    return collate_packed([Segment(s, [False] + [True] * (len(s) - 1), i) for i, s in enumerate(sequences)])


def logprobs(trainer) -> torch.Tensor:
    """The trainer's log-probs of tokens 1.. of every sequence, flattened."""
    trainer.eval()
    batch = batch_of(SEQUENCES)
    with torch.no_grad():
        return trainer(batch.to(trainer.device))[batch.loss_mask[0]].cpu()


def flat(rows):
    return torch.tensor([x for row in rows for x in row])


def main(path: str) -> None:
    dist = init_distributed()
    model = save_demo_policy(path)
    vllm = VLLMEngine(path, seed=0, max_model_len=64, enable_sleep_mode=True)
    engines = EngineGroup([Recording(vllm, "vllm")], remote=False)
    trainer = create_engine(PackedCausalLM(model), OPTIM, ZeroConfig(2, False, False, False), 1)
    trainer.offload_states = Recording(trainer, "deepspeed").offload_states
    trainer.reload_states = Recording(trainer, "deepspeed").reload_states
    colocation.can_offload = lambda engine: True  # a GPU's path on the CPU: DeepSpeed's offload runs here too
    sync = InHostSync(engines)
    turn = colocation.Colocation(engines, [trainer], lambda: sync.push(policy_weights(trainer.module, 2), True),
                                 dist.is_main)  # sleeps the engine
    try:
        sync.push(policy_weights(trainer.module, 2), True)
        asleep_push = "accepted"
    except RuntimeError as err:
        asleep_push = str(err)
    before = logprobs(trainer)
    CALLS.append("train")
    trainer.train()
    loss = -trainer(batch_of(SEQUENCES).to(trainer.device)).mean()
    trainer.backward(loss)
    trainer.step()
    expected = logprobs(trainer)
    with turn:
        CALLS.append("generate")
        scored = flat(vllm.score(SEQUENCES))
    print(json.dumps({"calls": CALLS, "diff": (scored - expected).abs().max().item(),
                      "moved": (before - expected).abs().max().item(), "asleep_push": asleep_push}))


if __name__ == "__main__":
    main(sys.argv[1])
