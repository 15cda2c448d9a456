"""Reward-model losses, hand-derived, and where a packed or padded batch's reward is read.

sigmoid: -log sigmoid(c - r - m). With c = 2, r = 1, m = 0: -log sigmoid(1) = log(1 + e^-1) = 0.31326;
with m = 1: -log sigmoid(0) = ln 2. logexp: log(1 + exp(r - c)) = log(1 + e^-1), the same number: the two
are one function without a margin. Centering adds coef * (c + r)^2 = 0.1 * 9 = 0.9.
"""

import math

import pytest
import torch

from openpack.core.batch import Segment, collate_packed, collate_padded, last_token_index
from openpack.core.reward_losses import reward_pair_losses

C, R = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.5])


def test_hand_derived_values():
    softplus_minus_one = math.log(1 + math.exp(-1))
    sigmoid = reward_pair_losses(C, R)
    torch.testing.assert_close(sigmoid, torch.tensor([softplus_minus_one, math.log(1 + math.exp(1.5))]))
    torch.testing.assert_close(reward_pair_losses(C, R, "logexp"), sigmoid)
    margin = reward_pair_losses(C, R, margin=torch.tensor([1.0, -1.5]))
    torch.testing.assert_close(margin, torch.tensor([math.log(2), math.log(2)]))
    centered = reward_pair_losses(C, R, center_rewards_coefficient=0.1)
    torch.testing.assert_close(centered - sigmoid, torch.tensor([0.9, 0.025]))


def test_a_margin_with_logexp_and_unknown_losses_are_refused():
    with pytest.raises(ValueError, match="takes no margin"):
        reward_pair_losses(C, R, "logexp", margin=torch.zeros(2))
    with pytest.raises(ValueError, match="unknown reward loss 'hinge'"):
        reward_pair_losses(C, R, "hinge")


def segments():
    return [Segment([5, 6, 7, 2], [False] * 4, 0), Segment([5, 8, 2], [False] * 3, 1), Segment([9, 9], [False] * 2, 2)]


def test_the_last_token_of_each_segment_packed_and_padded():
    packed = collate_packed(segments())
    assert last_token_index(packed).tolist() == [3, 6, 8]
    padded = collate_padded(segments(), pad_token_id=0)  # rows of 4: the last real tokens at 3, 4 + 2, 8 + 1
    assert last_token_index(padded).tolist() == [3, 6, 9]


def test_a_skipped_token_id_is_stepped_over_as_transformers_does_with_pad_equal_to_eos():
    """With pad == eos (2 here), transformers reads the last token that is not pad: the one before the eos."""
    assert last_token_index(collate_packed(segments()), skip_token_id=2).tolist() == [2, 5, 8]
    assert last_token_index(collate_padded(segments(), pad_token_id=2), skip_token_id=2).tolist() == [2, 5, 9]
    with pytest.raises(ValueError, match="segment 0 .* has no token"):
        last_token_index(collate_packed([Segment([2, 2], [False, False], 7)]), skip_token_id=2)
