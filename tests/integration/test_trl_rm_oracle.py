"""TRL 1.16's real RewardTrainer as the oracle for openpack's reward-model loss and gradient.

The same tiny Llama (10x Llama's init range, so rewards spread over ~1), the same 8 plain-text pairs, fp32
on CPU, the same initial value head (TRL's, copied into openpack's model):

* TRL: one optimizer step of a real ``RewardTrainer`` over one batch of all 8 pairs
  (``trl_reward_oracle.trl_first_step``): its loss, every gradient, and the ids it fed;
* openpack: ``tokenize_pairs`` -> ``PreferencePair.segments`` -> ``load_reward_model`` through
  ``PackedRewardModel`` -> ``pair_segments`` -> ``reward_pair_losses``, ``sum / 8`` backpropagated, in three
  layouts: ``packed`` (all 16 segments in one row, scrambled, so pairs are found only through the segment
  table), ``padded`` (right-padded rows), ``split`` (two packed micro-batches of 4 pairs, gradients
  accumulated, each ``sum / 8``: the step normalisation of ``trainers/rm.py``).

Each must give TRL's token ids exactly, its loss to 1e-5 and every gradient to atol = rtol = 1e-5, with
plain pairs, with per-pair margins (``--margin_key``) and with ``--center_rewards_coefficient``. (TRL takes
a mean per micro-batch; with one micro-batch that is the step's mean, which openpack takes in any layout.)
"""

from __future__ import annotations

import random

import pytest
import torch
from trl_reward_oracle import one_torch_thread, trl_first_step

from openpack.core.batch import collate_packed, collate_padded
from openpack.core.logprobs import pair_segments
from openpack.core.reward_losses import reward_pair_losses
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import Rows
from openpack.data.preference import tokenize_pairs
from openpack.models.reward import PackedRewardModel, load_reward_model
from openpack.models.tiny import tiny_causal_lm

pytest.importorskip("trl")

ROWS = [  # demo-tokenizer characters; 6 to 30 tokens with the eos
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
    {"prompt": "07+35=", "chosen": "42", "rejected": "43"},
    {"prompt": "q: what is one plus one\n", "chosen": "two", "rejected": "three"},
    {"prompt": "a b ", "chosen": "c d e f", "rejected": "x"},
    {"prompt": "12+0=", "chosen": "12", "rejected": "123"},
    {"prompt": "reverse: abcdef\n", "chosen": "fedcba", "rejected": "abcdef"},
    {"prompt": "9-3=", "chosen": "6", "rejected": "-6 or 12 or maybe 7"},
    {"prompt": "+-=: ", "chosen": "=", "rejected": "-"},
]
MARGINS = [0.5, -0.25, 1.0, 0.0, 2.0, -1.0, 0.75, 0.1]
CASES = {"plain": (False, 0.0), "margins": (True, 0.0), "centered": (False, 0.05), "margins+centered": (True, 0.01)}
LAYOUTS = ("packed", "padded", "split")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_rm_oracle")
    tokenizer = build_demo_tokenizer()
    tiny_causal_lm("llama", seed=3, vocab_size=len(tokenizer), max_position_embeddings=256,
                   initializer_range=0.2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def rows_with_margins(use_margins: bool) -> list[dict]:
    return [{**row, "score_margin": m} for row, m in zip(ROWS, MARGINS)] if use_margins else ROWS


def openpack_step(model_dir, rows, use_margins: bool, coefficient: float, score_weight, layout: str):
    """openpack's loss and gradients for one step over every pair, and the ids it fed."""
    tokenizer = build_demo_tokenizer()
    pairs, _ = tokenize_pairs(Rows(rows, [f"row {i}" for i in range(len(rows))]), tokenizer, max_len=128,
                              margin_key="score_margin" if use_margins else None)
    model = load_reward_model(model_dir, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.score.weight.copy_(score_weight)
    module = PackedRewardModel(model)
    segments = [seg for i, pair in enumerate(pairs) for seg in pair.segments(i)]
    margins = torch.tensor([pair.margin for pair in pairs])
    if layout == "packed":
        batches = [collate_packed(random.Random(0).sample(segments, len(segments)))]
    elif layout == "padded":
        batches = [collate_padded(segments, tokenizer.pad_token_id)]
    else:
        batches = [collate_packed(segments[:8]), collate_packed(segments[8:])]
    total = 0.0
    for batch in batches:
        ids, chosen_at, rejected_at = pair_segments(batch)  # as trainers/rm.py finds the pairs
        rewards = module(batch)
        chosen, rejected = rewards[chosen_at], rewards[rejected_at]
        losses = reward_pair_losses(chosen, rejected, "sigmoid", margins[ids] if use_margins else None, coefficient)
        (losses.sum() / len(pairs)).backward()
        total += losses.sum().item() / len(pairs)
    grads = {name: p.grad for name, p in model.named_parameters()}
    return total, grads, [list(seg.tokens) for seg in segments]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_gradient_and_tokens_match_trl_reward_trainer(model_dir, case, layout):
    use_margins, coefficient = CASES[case]
    rows = rows_with_margins(use_margins)
    trl = trl_first_step(model_dir, rows, margin_key="score_margin" if use_margins else None,
                         center_rewards_coefficient=coefficient or None, max_length=128)
    assert trl.kept == list(range(len(ROWS)))  # nothing over max_length: TRL would drop, not truncate
    loss, grads, tokens = openpack_step(model_dir, rows, use_margins, coefficient, trl.score_weight, layout)
    assert tokens == [ids for pair in zip(trl.chosen_ids, trl.rejected_ids) for ids in pair]
    assert abs(loss - trl.loss) <= 1e-5, (loss, trl.loss)
    assert grads.keys() == trl.grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl.grads[name], atol=1e-5, rtol=1e-5, msg=name)
