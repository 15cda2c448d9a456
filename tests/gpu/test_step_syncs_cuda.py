"""CUDA host syncs per training step (issue 16): the trainers' step code adds none per micro-batch.

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA
call warn (``.item()``, a blocking copy to or from the host, ``nonzero``
behind a boolean mask); each warning names the Python line that made the
call. SFT, DPO and RM steps (``trainers/sft.py``, ``dpo.py``, ``rm.py``, the
code the CLI runs) train a tiny bf16 model on CUDA with 1 and with 4 micro-batches
per step, through a plain-torch stand-in for the DeepSpeed engine (the GPU
machine has no DeepSpeed; DeepSpeed's own syncs in its optimizer step are
not counted here, the CPU test counts its host reads). Asserted: inside the
step, the trainers' own files (``openpack/trainers/``) sync as often with 4
micro-batches as with 1, and reading a step's metrics syncs once. Printed
(``-s``; the GPU runbook keeps it): every sync by file and line, the
library parts' per-micro-batch ones included (none expected from a batch's copy
to the device, pinned and asynchronous, or from finding labels and pairs, done on
the host; PPO's boolean masks and RM's last-token check remain), for docs/verification.md.

Run on a GPU machine: ``python -m pytest tests/gpu -q -s``.
"""

import collections
import warnings

import pytest
import torch

from openpack.core.batch import CHOSEN, REJECTED, Segment
from openpack.core.losses import LossParams
from openpack.core.schedule import RankStep
from openpack.distributed.process import DistInfo
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.dpo import PreferenceObjective, dpo_step
from openpack.trainers.reference import ModelReference
from openpack.trainers.rm import RewardObjective, rm_step
from openpack.trainers.sft import train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB, SAMPLES = 256, 8
DEVICE = torch.device("cuda")
BF16 = torch.bfloat16  # the auto backend is then a varlen kernel (fp32 falls back to SDPA per segment)


class PlainEngine:
    """What the step functions use of DeepSpeed's engine, on plain torch: AdamW on the weights, no ZeRO."""

    def __init__(self, module: torch.nn.Module):
        from openpack.distributed.nonfinite import StepGuard

        self.module, self.boundary, self.global_steps = module, True, 0
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        self.step_guard = StepGuard()  # the non-finite check: its one read per step is in openpack/distributed/
        self.step_guard.engine = self

    def __call__(self, batch, **kwargs):
        return self.module(batch, **kwargs)

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundary = boundary

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        if self.boundary:
            if not self.step_guard.skips():
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1

    def was_step_applied(self) -> bool:
        return True

    def get_lr(self) -> list[float]:
        return [self.optimizer.param_groups[0]["lr"]]

    def zero_optimization_stage(self) -> int:
        return 0

    def bfloat16_enabled(self) -> bool:
        return False


def syncs(fn) -> collections.Counter:
    """The synchronising CUDA calls ``fn()`` makes, by ``file:line``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def in_trainers(counts: collections.Counter) -> int:
    return sum(n for where, n in counts.items() if "/openpack/trainers/" in where)


def planned(micro_batches: int, label_tokens: tuple[int, ...], tokens: int) -> RankStep:
    ids = list(range(SAMPLES))
    size = SAMPLES // micro_batches
    return RankStep(0, 0, [ids[i:i + size] for i in range(0, SAMPLES, size)], SAMPLES, tokens, label_tokens,
                    micro_batches, None)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sft_sample(i: int) -> list[Segment]:
    n = 8 + (i * 5) % 17
    return [Segment(tokens(i, n), [False] + [True] * (n - 1), i)]


def pair(i: int) -> list[Segment]:
    prompt, chosen, rejected = tokens(i, 3), tokens(100 + i, 3 + i % 5), tokens(200 + i, 6 + i % 3)
    return [Segment(prompt + answer, [False] * 3 + [True] * len(answer), i, role)
            for answer, role in ((chosen, CHOSEN), (rejected, REJECTED))]


def step_syncs(segments, label_tokens, step_fn) -> dict:
    """Per number of micro-batches: the syncs inside a second step (the first warms up), and in reading it."""
    dist = DistInfo(0, 1, 0, DEVICE)
    batcher = MicroBatcher(segments, packing_samples=True)
    tokens = sum(len(s.tokens) for i in range(SAMPLES) for s in segments(i))
    result = {}
    for micro_batches in (1, 4):
        plan = planned(micro_batches, label_tokens, tokens)
        step_fn(batcher, plan, dist).read()
        metrics = {}
        inside = syncs(lambda: metrics.setdefault("m", step_fn(batcher, plan, dist)))
        reading = syncs(lambda: metrics["m"].read())
        print(f"\n{step_fn.__name__}, {micro_batches} micro-batches: {sum(inside.values())} syncs in the step "
              f"({in_trainers(inside)} in openpack/trainers), {sum(reading.values())} reading it")
        for where, n in sorted(inside.items()):
            print(f"  {n:3d}  {where}")
        result[micro_batches] = (inside, reading)
    return result


def assert_constant(result) -> None:
    (one, read_one), (four, read_four) = result[1], result[4]
    assert in_trainers(four) == in_trainers(one), (one, four)
    assert sum(read_one.values()) <= 1 and sum(read_four.values()) <= 1, (read_one, read_four)


def test_sft_step_syncs_do_not_grow_with_micro_batches():
    engine = PlainEngine(PackedCausalLM(tiny_causal_lm("qwen2", dtype=BF16, vocab_size=VOCAB)).to(DEVICE))
    labels = sum(sum(sft_sample(i)[0].targets[1:]) for i in range(SAMPLES))

    def step(batcher, plan, dist):
        return train_step(engine, batcher, plan, dist)
    step.__name__ = "sft"
    assert_constant(step_syncs(sft_sample, (labels,), step))


def test_dpo_step_syncs_do_not_grow_with_micro_batches():
    engine = PlainEngine(PackedCausalLM(tiny_causal_lm("qwen2", dtype=BF16, vocab_size=VOCAB)).to(DEVICE))
    reference = ModelReference(PackedCausalLM(tiny_causal_lm("qwen2", seed=1, dtype=BF16, vocab_size=VOCAB)).to(DEVICE),
                               DEVICE)
    objective = PreferenceObjective(["sigmoid"], [1.0], LossParams(beta=0.1), reference)
    chosen = sum(sum(pair(i)[0].targets[1:]) for i in range(SAMPLES))
    rejected = sum(sum(pair(i)[1].targets[1:]) for i in range(SAMPLES))

    def step(batcher, plan, dist):
        return dpo_step(engine, batcher, objective, plan, dist)
    step.__name__ = "dpo"
    assert_constant(step_syncs(pair, (chosen, rejected), step))


def test_rm_step_syncs_do_not_grow_with_micro_batches(tmp_path):
    from openpack.models.reward import PackedRewardModel, load_reward_model

    tiny_causal_lm("qwen2", dtype=BF16, vocab_size=VOCAB).save_pretrained(tmp_path / "base")
    engine = PlainEngine(PackedRewardModel(load_reward_model(str(tmp_path / "base"), bf16=True, pad_token_id=0)).to(DEVICE))
    objective = RewardObjective("sigmoid", 0.01, torch.linspace(-0.5, 0.5, SAMPLES))

    def step(batcher, plan, dist):
        return rm_step(engine, batcher, objective, plan, dist)
    step.__name__ = "rm"
    assert_constant(step_syncs(pair, (0, 0), step))
