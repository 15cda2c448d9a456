"""The reward model on CUDA in bf16 against the CPU in fp32. Skipped without a GPU; never faked.

Why (issue 43): on an H200 on 2026-11-27 the GPU runbook's ``train_rm`` step-1 loss was 0.6606 in bf16 on the GPU
against 0.6950 for the same command in fp32 on the same machine's CPU (8 pairs, a random Qwen2.5-0.5B shape, a new
head), outside the 1% tolerance that SFT (5e-5 off) and DPO (3.7e-3 off) met. On the CPU, bf16 against fp32 moved
tiny models' RM losses by 5e-4 and the 0.5B shape's rewards by about 0.01. These tests split the two causes left:
the new head drawn differently in a GPU process, or the reward read differently from a packed row on the GPU.
"""

import pytest
import torch

from openpack.core.batch import CHOSEN, REJECTED, Segment, collate_packed
from openpack.models.attention import set_attention_backend
from openpack.models.reward import PackedRewardModel, load_reward_model
from openpack.models.tiny import tiny_causal_lm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTHS = [(5, 9), (31, 4), (64, 70), (2, 3), (120, 17)]  # (prompt, response) per segment


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen2 causal LM (GQA, head_dim 32) saved as any HF folder: train_rm's --pretrain."""
    path = tmp_path_factory.mktemp("rm_base")
    model = tiny_causal_lm("qwen2", seed=3, attn_implementation="sdpa", hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, vocab_size=64)
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    return str(path)


def pairs_batch():
    gen = torch.Generator().manual_seed(0)
    segments = []
    for i, (prompt, response) in enumerate(LENGTHS):
        ids = torch.randint(1, 64, (prompt,), generator=gen).tolist()
        for role in (CHOSEN, REJECTED):
            tail = torch.randint(1, 64, (response,), generator=gen).tolist()
            segments.append(Segment(ids + tail, [False] * prompt + [True] * response, i, role))
    return segments


def rewards(model, segments, device, backend):
    set_attention_backend(backend)
    try:
        with torch.no_grad():
            return PackedRewardModel(model.to(device).eval())(collate_packed(segments).to(device)).cpu()
    finally:
        set_attention_backend("auto")


def test_the_new_head_is_drawn_the_same_in_bf16_on_a_gpu_machine(base):
    torch.manual_seed(0)
    cpu = load_reward_model(base, bf16=False)
    torch.cuda.manual_seed_all(123)  # the CUDA generator must not matter: the head is drawn on the CPU
    torch.manual_seed(0)
    gpu = load_reward_model(base, bf16=True).cuda()
    assert torch.equal(gpu.score.weight.cpu(), cpu.score.weight.to(torch.bfloat16))


def test_packed_bf16_rewards_on_cuda_match_fp32_on_the_cpu_and_one_at_a_time(base):
    """Packed bf16 on torch_varlen == each segment alone on the GPU (same arithmetic but the row), and both within
    bf16's error of fp32 SDPA on the CPU: a reward read at the wrong token is off by the rewards' own spread."""
    segments = pairs_batch()
    torch.manual_seed(0)
    model = load_reward_model(base, bf16=False)
    fp32 = rewards(model, segments, "cpu", "sdpa")
    packed = rewards(model.to(torch.bfloat16), segments, "cuda", "torch_varlen")
    alone = torch.cat([rewards(model, [s], "cuda", "torch_varlen") for s in segments])
    spread = float(fp32.std())
    assert spread > 0.05, fp32  # the rewards differ enough for a misread one to show
    assert (packed - alone).abs().max() <= 0.02 * spread + 1e-3, (packed, alone)
    assert (packed - fp32).abs().max() <= 0.1 * spread, (packed, fp32)
