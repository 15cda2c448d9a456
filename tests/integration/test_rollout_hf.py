"""HFEngine (``--rollout_backend hf``) on a tiny model with openpack's packed attention, no vLLM needed.

Seeded sampling repeats, raw log-probs equal a temperature-1 scoring of the same tokens, stops cut a
completion after the stop token, and the trainer's RNG stream is left as it was.
"""

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
