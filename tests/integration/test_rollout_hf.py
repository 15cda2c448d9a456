"""HFEngine (``--rollout_backend hf``) on a tiny model with openpack's packed attention, no vLLM needed.

Seeded sampling repeats, raw log-probs equal a temperature-1 scoring of the same tokens, stops cut a
completion after the stop token, and the trainer's RNG stream is left as it was.
"""

from dataclasses import replace

import pytest
import torch

from openpack.models.tiny import tiny_causal_lm
from openpack.rollout.hf_engine import HFEngine
from openpack.rollout.interface import SamplingConfig

PROMPTS = [[1, 5, 6, 7], [2, 9], [4, 20, 21, 22, 23, 24]]


def engine():
    model = tiny_causal_lm("llama", seed=2, vocab_size=32, hidden_size=64).train()  # training mode, as the policy is
    return HFEngine(model, pad_token_id=0, eos_token_id=3)


def tokens(rows):
    return [[c.tokens for c in row] for row in rows]


def test_seeded_sampling_repeats_and_leaves_the_global_rng_alone():
    hf = engine()
    sampling = SamplingConfig(n=2, temperature=0.9, top_p=0.95, max_tokens=8, stop_token_ids=[3])
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = hf.generate(PROMPTS, sampling, seeds=[1, 2, 3])
    assert torch.equal(torch.rand(1), expected_next)
    assert tokens(hf.generate(PROMPTS, sampling, seeds=[1, 2, 3])) == tokens(first)
    assert tokens(hf.generate(PROMPTS, sampling, seeds=[4, 5, 6])) != tokens(first)
    assert [len(row) for row in first] == [2, 2, 2] and hf.model.training


def test_logprobs_are_raw_and_stops_cut_the_completion():
    hf = engine()
    sampling = SamplingConfig(n=4, temperature=1.5, top_p=0.5, max_tokens=10, stop_token_ids=[3, 5])
    rows = hf.generate(PROMPTS, sampling, seeds=[7, 8, 9])
    samples = [(PROMPTS[i], c) for i, row in enumerate(rows) for c in row]
    scored = hf.score([prompt + c.tokens for prompt, c in samples])
    for (_, c), s in zip(samples, scored):
        assert len(c.tokens) == len(c.logprobs)
        assert max(abs(a - b) for a, b in zip(c.logprobs, s[-len(c.tokens):])) <= 1e-4  # temperature 1, no top-p
        stops = [t in (3, 5) for t in c.tokens]
        assert c.finished == any(stops) and (not c.finished or stops.index(True) == len(c.tokens) - 1)
        assert c.finished or len(c.tokens) == 10
    assert any(c.finished for _, c in samples)


def test_greedy_equals_a_one_prompt_at_a_time_decode():
    """Left padding does not change greedy tokens: the batch equals each prompt alone."""
    hf = engine()
    sampling = SamplingConfig(temperature=0.0, max_tokens=6)
    batch = tokens(hf.generate(PROMPTS, sampling, seeds=[0, 0, 0]))
    alone = [tokens(hf.generate([p], sampling, seeds=[0]))[0] for p in PROMPTS]
    assert batch == alone


def test_a_shared_budget_cuts_each_completion_at_what_its_prompt_leaves():
    """--max_len (OpenRLHF's --data.max_len alone): a completion gets ``max_total - len(prompt)`` tokens. generate
    takes one max_new_tokens for the batch; cutting each row at its own budget gives what stopping there would:
    the same seeds without the budget sample the same tokens, longer."""
    hf = engine()
    free = SamplingConfig(n=2, temperature=1.0, max_tokens=10, stop_token_ids=[3])
    shared = replace(free, max_total=9)  # prompts of 4, 2 and 6 tokens: budgets 5, 7 and 3
    budgets = [9 - len(p) for p in PROMPTS]
    rows, longer = hf.generate(PROMPTS, shared, seeds=[1, 2, 3]), hf.generate(PROMPTS, free, seeds=[1, 2, 3])
    for budget, row, long_row in zip(budgets, rows, longer):
        for c, long in zip(row, long_row):
            assert c.tokens == long.tokens[:budget] and c.logprobs == pytest.approx(long.logprobs[:budget], abs=1e-6)
            assert c.finished == (3 in c.tokens) and (c.finished or len(c.tokens) == budget)
    assert [max(len(c.tokens) for c in row) for row in longer] != budgets  # the budget bound somewhere
