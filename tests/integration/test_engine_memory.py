"""What the DeepSpeed engine holds besides weights, gradients and AdamW states (issue 23).

On SmolLM2-135M in fp32 these were 2.7 GB of the 9.2 GB a ZeRO-2 rank peaked at
(``benchmarks/memory_real_model.py``): a reduce bucket of DeepSpeed's 5e8 elements
that held a second copy of every gradient, and an fp32 "master" clone of fp32
weights. The numbers the engine computes stay the same: ``test_zero_stages``
checks ZeRO-2 against ZeRO-0 step by step.
"""

import pytest
import torch

from openpack.core.batch import collate_packed
from openpack.distributed.engine import (DEEPSPEED_BUCKET, OptimConfig, ZeroConfig, bucket_elements, create_engine,
                                         deepspeed_config, optimizer_step)
from openpack.distributed.process import init_distributed
from openpack.models.memory import HeapTrimmer, release_freed_memory, resident_bytes
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.models.verify import random_segments

OPTIM = OptimConfig(1e-3, 0.1, (0.9, 0.95), "constant", 0, 10, 0.1, 1.0)


@pytest.mark.parametrize("num_params", [1_000, 134_515_008, 7_000_000_000])
def test_buckets_hold_at_most_an_eighth_of_the_model(num_params):
    """135M parameters: 16.8M-element buckets (67 MB in fp32) instead of 5e8 (2 GB); a 7B model keeps the default."""
    zero = deepspeed_config(ZeroConfig(2, False, False, False), 1.0, 1, num_params)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == bucket_elements(num_params)
    assert bucket_elements(num_params) <= num_params / 8 and bucket_elements(num_params) <= DEEPSPEED_BUCKET
    assert bucket_elements(7_000_000_000) == DEEPSPEED_BUCKET


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_master_is_the_weights_partition_and_steps_them(stage):
    """The optimizer's fp32 partition shares the flat weights' memory (no clone), and a step moves the weights,
    DeepSpeed's per-parameter fp32 views included."""
    dist = init_distributed()
    engine = create_engine(PackedCausalLM(tiny_causal_lm("qwen2", seed=5)), OPTIM,
                           ZeroConfig(stage, False, False, False), 1)
    optimizer = engine.optimizer
    for master, partitions in zip(optimizer.single_partition_of_fp32_groups,
                                  optimizer.parallel_partitioned_bit16_groups):
        assert master.data_ptr() == partitions[0].data_ptr()
    param = next(p for p in engine.module.parameters() if p.ndim == 2)
    before = param.detach().clone()
    batch = collate_packed(random_segments([5, 9, 3], 256, 0))
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(-engine(batch.to(dist.device)).sum() / 17)
    optimizer_step(engine)
    assert not torch.equal(param.detach(), before)
    from deepspeed.utils import safe_get_full_fp32_param

    assert torch.equal(safe_get_full_fp32_param(param), param.detach())


def resident_mib() -> float:
    return resident_bytes() / 2**20


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_activations_go_back_to_the_os():
    """Activation-sized tensors freed below a live one stay in glibc's heap until trimmed (the fragmentation that
    made a SmolLM2 rank peak at 1.42x TRL); ``release_freed_memory`` hands them back."""
    torch.empty(1 << 20).zero_()  # a freed 4 MiB mapping raises glibc's mmap threshold: what follows is heap
    tensors = [torch.ones(1 << 20) for _ in range(64)]  # 256 MiB of 4 MiB "activations"
    keep = tensors.pop()  # the last one stays alive, so the heap's top cannot shrink by itself
    del tensors
    held = resident_mib()
    release_freed_memory()
    assert held - resident_mib() > 128, "the freed tensors' pages were not returned"
    assert keep.sum() == 1 << 20


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_is_trimmed_only_after_it_grew_by_the_margin():
    """A tiny model's step frees a few MB: trimming it every time cost a third of its step (page faults after each
    trim), so ``HeapTrimmer`` trims only when the resident set grew by its margin since the last trim."""
    trim = HeapTrimmer(margin=128 << 20)
    trim()
    assert trim.trims == 1  # the first call trims: nothing to compare with yet
    torch.empty(1 << 20).zero_()  # raise glibc's mmap threshold: what follows comes from the heap
    small = [torch.ones(1 << 18) for _ in range(16)]  # 16 MiB of a tiny model's activations
    del small
    trim()
    assert trim.trims == 1, "a step that freed 16 MiB was trimmed"
    tensors = [torch.ones(1 << 20) for _ in range(64)]  # 256 MiB of 4 MiB activations, freed below a live one
    keep = tensors.pop()
    del tensors
    held = resident_mib()
    trim()
    assert trim.trims == 2 and held - resident_mib() > 128, "256 MiB freed were not handed back"
    assert keep.sum() == 1 << 20


def test_cpu_engines_trim_after_every_backward_and_step(monkeypatch):
    import openpack.distributed.engine as engine_module

    calls = []

    class Counted(HeapTrimmer):
        def __call__(self):
            calls.append(1)
            super().__call__()

    monkeypatch.setattr(engine_module, "HeapTrimmer", Counted)
    dist = init_distributed()
    engine = create_engine(PackedCausalLM(tiny_causal_lm("qwen2", seed=5)), OPTIM,
                           ZeroConfig(2, False, False, False), 1)
    batch = collate_packed(random_segments([5, 9, 3], 256, 0))
    for boundary in (False, True):  # two micro-batches: DPO and RM step after each, only the last updates
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(-engine(batch.to(dist.device)).sum() / 17)
        optimizer_step(engine) if boundary else engine.step()
    assert len(calls) == 4


def test_a_zero_engine_trains_without_importing_deepspeeds_muon():
    """DeepSpeed imports its Muon optimizer (torch.compile'd kernels: 1.3-1.6 s and 40-190 MB a process) to ask
    whether the optimizer is Muon, at engine build and at ZeRO-2's first gradient reduction; openpack's stand-in
    answers instead, in a fresh process that builds an engine and takes a step."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from openpack.core.batch import collate_packed\n"
            "from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine, optimizer_step\n"
            "from openpack.distributed.process import init_distributed\n"
            "from openpack.models.packed import PackedCausalLM\n"
            "from openpack.models.tiny import tiny_causal_lm\n"
            "from openpack.models.verify import random_segments\n"
            "init_distributed()\n"
            f"engine = create_engine(PackedCausalLM(tiny_causal_lm('llama', seed=1)), {OPTIM!r}, "
            "ZeroConfig(2, False, False, False), 1)\n"
            "batch = collate_packed(random_segments([5, 9, 3], 256, 0))\n"
            "engine.set_gradient_accumulation_boundary(True)\n"
            "engine.backward(-engine(batch).sum())\n"
            "optimizer_step(engine)\n"
            "muon = sys.modules.get('deepspeed.runtime.zero.muon.muon_optimizer')\n"
            "print('real muon imported:', muon is not None and not muon.__doc__.startswith('openpack'))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "real muon imported: False" in result.stdout
    # ChunkedAdamW is torch AdamW: listed as ZeRO-supported, so the engine does not warn it is untested
    assert "untested optimizer" not in result.stdout + result.stderr
