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
from openpack.models.memory import return_freed_tensors_to_os
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


def test_heap_threshold_is_set_on_glibc():
    """glibc (the Linux CI and the images) takes the fixed mmap threshold; elsewhere the call is a no-op."""
    import platform

    taken = return_freed_tensors_to_os()
    if platform.libc_ver()[0] == "glibc":
        assert taken
