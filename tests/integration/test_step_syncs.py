"""Host reads per training step (issue 16): none per micro-batch, one per logged step.

A host read of a device tensor (``.item()``, ``.tolist()``, ``.cpu()``,
``float(t)``) waits on a GPU for every queued kernel. On CPU there is no
queue, so this test counts the calls instead: those four methods of
``torch.Tensor`` are patched to count their callers while the real CLI
trains (one CPU rank: DeepSpeed's stage 0, gloo), in a layout of 1 micro-batch per step and
one of 8. The count inside a step must be the same for both (no read per
micro-batch): one ``.tolist()`` of the step's loss and grad norm at its optimizer step (since issue 44: a
non-finite step is skipped before its update), and reading a step's metrics (``run_steps``, on logged steps
only) takes one more; steps that are not logged are never read.

Not counted: ``openpack/models/attention.py``, whose CPU backend (SDPA per
segment, the reference) reads each row's segment lengths on the host per
layer; the CUDA backends take ``cu_seqlens`` on the device
(tests/gpu/test_step_syncs_cuda.py counts real CUDA syncs there). Measured
2026-11-23 with n micro-batches: before this change a step read 4 + n (SFT),
4 + 7n (DPO), 4 + 5n (RM), 5 + 10n (a PPO policy step), every step; now 0
whatever n, and 1 ``.tolist()`` when a step is logged (docs/verification.md
has the table). Torch's AdamW reading its step counter is not counted (below).
"""

import collections
import contextlib
import sys

import pytest
import torch

import openpack.distributed.nonfinite
import openpack.trainers.dpo_worker
import openpack.trainers.metrics
import openpack.rl.update
import openpack.trainers.rm_worker
import openpack.trainers.sft_worker
from openpack.cli import train_dpo, train_ppo, train_rm, train_sft

from saved_runs import BARE_PROMPTS, write_pairs

READS = ("item", "tolist", "cpu", "__float__")
NOT_COUNTED = ("openpack/models/attention.py",)  # the CPU attention backend's per-segment loop (see above)
STEPS = ["--train_batch_size", "8", "--max_steps", "4", "--logging_steps", "2", "--learning_rate", "1e-3",
         "--max_len", "96", "--seed", "1", "--launcher", "local", *BARE_PROMPTS]
# Not counted either: torch's AdamW reads its step counter (``torch/optim/optimizer.py``, ``_get_value``) once per
# tensor it steps, which is once per parameter group under ZeRO-1/2 and once per parameter at stage 0 (one CPU rank).
# The counter is a CPU tensor on every device (``ChunkedAdamW`` makes it), so the read waits on no kernel.
STEP_COUNTER = ("item", "torch/optim/optimizer.py")
# Host reads inside a step, whatever its micro-batches: one, the optimizer step's [loss, grad norm], read before the
# update to skip a non-finite step on every rank (issue 44, ``distributed/nonfinite.py``). DeepSpeed's step is host
# code, so the decision to take it must be on the host; its ZeRO paths read the norm there anyway.
PER_STEP = 1
NONFINITE_CHECK = "tolist in " + openpack.distributed.nonfinite.__file__
LAYOUTS = {1: ["--micro_train_batch_size", "8"], 8: ["--micro_train_batch_size", "1"]}  # micro-batches per step


class ReadCounter:
    """Host reads by phase: ``("step", n)`` inside step n's function, ``("after", n)`` from its return to the next."""

    def __init__(self):
        self.phase, self.steps = None, 0
        self.counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)

    def record(self, name: str) -> None:
        caller = sys._getframe(2).f_code.co_filename
        if (name, caller.split("site-packages/")[-1]) == STEP_COUNTER:
            return
        if self.phase is not None and not caller.endswith(NOT_COUNTED):
            self.counts[self.phase][f"{name} in {caller.split('site-packages/')[-1]}"] += 1

    def wrap_step(self, step):
        def counted(*args, **kwargs):
            self.steps += 1
            self.phase = ("step", self.steps)
            result = step(*args, **kwargs)
            self.phase = ("after", self.steps)
            return result
        return counted

    def total(self, phase) -> int:
        return sum(self.counts[phase].values())


@contextlib.contextmanager
def counting(module, *step_names: str):
    """Count host reads while ``module.<step_name>`` (the step functions the trainer calls) and what follows run."""
    counter = ReadCounter()
    with pytest.MonkeyPatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def patched(self, *args, _original=original, _name=name, **kwargs):
                counter.record(_name)
                return _original(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, patched)
        for step_name in step_names:
            patch.setattr(module, step_name, counter.wrap_step(getattr(module, step_name)))
        try:
            yield counter
        finally:
            counter.phase = None


def assert_no_reads_per_micro_batch(runs: dict[int, ReadCounter], steps: int = 4):
    one, many = runs[1], runs[8]
    assert one.steps == many.steps == steps
    for n in range(1, steps + 1):
        assert one.counts[("step", n)] == many.counts[("step", n)], (n, one.counts, many.counts)
        assert many.counts[("step", n)] == {NONFINITE_CHECK: PER_STEP}, many.counts[("step", n)]
    for n in (1, 3):  # not logged: never read
        assert many.total(("after", n)) == 0, many.counts[("after", n)]
    assert many.counts[("after", 2)] == {"tolist in " + openpack.trainers.metrics.__file__: 1}


def test_sft_reads_nothing_per_micro_batch(tmp_path, tiny_pretrain, sft_jsonl):
    runs = {}
    for micro_batches, layout in LAYOUTS.items():
        with counting(openpack.trainers.sft_worker, "train_step") as runs[micro_batches]:
            assert train_sft.main(["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path",
                                   str(tmp_path / str(micro_batches)), *STEPS, *layout]) == 0
    assert_no_reads_per_micro_batch(runs)


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_pair_steps_read_nothing_per_micro_batch(command, tmp_path, tiny_pretrain, tiny_reference):
    main, worker, step, reference = {
        "dpo": (train_dpo.main, openpack.trainers.dpo_worker, "dpo_step", ["--ref_pretrain", tiny_reference]),
        "rm": (train_rm.main, openpack.trainers.rm_worker, "rm_step", []),
    }[command]
    dataset = str(write_pairs(tmp_path / "pairs.jsonl"))
    runs = {}
    for micro_batches, layout in LAYOUTS.items():
        with counting(worker, step) as runs[micro_batches]:
            assert main(["--pretrain", tiny_pretrain, *reference, "--dataset", dataset, "--save_path",
                         str(tmp_path / str(micro_batches)), *STEPS, *layout]) == 0
    assert_no_reads_per_micro_batch(runs)


PPO = ["--advantage_estimator", "gae", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
       "--train_batch_size", "8", "--max_epochs", "2", "--generate_max_len", "8", "--prompt_max_len", "32",
       "--learning_rate", "1e-3", "--seed", "1", "--max_steps", "1", "--init_kl_coef", "0.05",
       "--rollout_backend", "hf", "--launcher", "local"]


def test_ppo_updates_read_nothing_per_micro_batch(tmp_path, ppo_models):
    """The update loop only (generation, rewards and packing plans are host work by nature): the policy's and the
    critic's optimizer steps of one rollout batch read nothing; ``train_on`` reads them all once afterwards."""
    runs = {}
    for micro_batches, layout in LAYOUTS.items():
        with counting(openpack.rl.update, "policy_step", "critic_step") as runs[micro_batches]:
            assert train_ppo.main(["--pretrain", str(ppo_models / "model"), "--prompt_data",
                                   str(ppo_models / "prompts.jsonl"), "--reward_pretrain", str(ppo_models / "rm"),
                                   "--save_path", str(tmp_path / str(micro_batches)), *PPO, *layout]) == 0
    one, many = runs[1], runs[8]
    assert one.steps == many.steps == 8  # 16 completions in steps of 8, 2 epochs, critic and policy
    for n in range(1, 9):
        assert one.counts[("step", n)] == many.counts[("step", n)], (n, one.counts, many.counts)
        assert many.counts[("step", n)] == {NONFINITE_CHECK: PER_STEP}, many.counts[("step", n)]
