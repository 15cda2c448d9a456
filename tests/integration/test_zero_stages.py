"""ZeRO-0, ZeRO-2 and ZeRO-3 give the same steps, with ZeRO-3 really partitioning every parameter.

The chunked LM head reads ``lm_head.weight`` outside ``lm_head.forward``; with
a persistence threshold of 0 that weight is partitioned (shape [0] between
forwards) exactly as a real 128k-vocab head would be, so this checks
DeepSpeed gathers it for our forward and backward.
"""

import pytest

from openpack.core.batch import collate_packed
from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine, optimizer_step
from openpack.distributed.process import init_distributed
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.models.verify import random_segments

OPTIM = OptimConfig(1e-3, 0.0, (0.9, 0.95), "constant", 0, 10, 0.1, 100.0)


def two_steps(stage, tied=False):
    dist = init_distributed()
    engine = create_engine(PackedCausalLM(tiny_causal_lm("qwen2", seed=5, tie_word_embeddings=tied)), OPTIM,
                           ZeroConfig(stage, False, False, False, param_persistence_threshold=0), 1)
    results = []
    for seed in (0, 1):
        rows = [collate_packed(random_segments([5, 9, 3], 256, seed)), collate_packed(random_segments([7, 2], 256, seed + 10))]
        total = 0.0
        for i, batch in enumerate(rows):  # two micro-batches, one optimizer step
            engine.set_gradient_accumulation_boundary(i == len(rows) - 1)
            loss = -engine(batch.to(dist.device)).sum() / 26
            engine.backward(loss)
            norm = float(optimizer_step(engine)) if i == len(rows) - 1 else engine.step()
            total += loss.item()
        results.append((total, norm))
    head = engine.module.model.lm_head.weight
    return results, head.numel()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero_stages_agree_and_zero3_partitions_the_head(tied):
    """Tied: the head is the input embedding's weight, read outside lm_head.forward (issue 23: partitioned there)."""
    reference, _ = two_steps(0, tied)
    for stage in (2, 3):
        results, head_numel = two_steps(stage, tied)
        for (loss, norm), (ref_loss, ref_norm) in zip(results, reference):
            assert loss == pytest.approx(ref_loss, abs=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
        if stage == 3:
            assert head_numel == 0  # partitioned between forwards, as a real head would be
