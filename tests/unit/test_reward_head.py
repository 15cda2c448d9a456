"""A reward model's new head: transformers' fp32 draw, and in bf16 that draw rounded whatever torch's bf16 sampler
does (issue 43: an H200 machine with torch 2.11 drew another bf16 head from the same seed, and train_rm's bf16
step-1 loss was 0.034 off its fp32 loss)."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from openpack.models.reward import load_reward_model
from openpack.models.tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm_head_base")
    model = tiny_causal_lm("qwen2", seed=3, attn_implementation="sdpa", hidden_size=64, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=128, vocab_size=64)
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    return str(path)


def test_an_fp32_head_is_the_one_transformers_draws(base):
    torch.manual_seed(7)
    theirs = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    after_theirs = torch.rand(3)
    torch.manual_seed(7)
    ours = load_reward_model(base, bf16=False)
    assert torch.equal(ours.score.weight, theirs.score.weight)
    assert torch.equal(torch.rand(3), after_theirs)  # the seed moves on as transformers' load left it


def test_a_bf16_head_is_the_fp32_head_rounded_whatever_the_bf16_sampler(base, monkeypatch):
    torch.manual_seed(7)
    fp32 = load_reward_model(base, bf16=False).score.weight.detach()
    normal_ = torch.Tensor.normal_

    def another_bf16_stream(self, *args, **kwargs):  # as torch 2.11's bf16 sampler did on the H200 machine
        out = normal_(self, *args, **kwargs)
        return out.neg_() if self.dtype == torch.bfloat16 else out

    monkeypatch.setattr(torch.Tensor, "normal_", another_bf16_stream)
    torch.manual_seed(7)
    bf16 = load_reward_model(base, bf16=True).score.weight.detach()
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, fp32.to(torch.bfloat16))
