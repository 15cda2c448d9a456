"""Shared fixtures: tiny saved model folders, a JSONL dataset with varied lengths, pairs and RL prompts, all offline.

Functions tests import live in ``saved_runs.py``, not here: tests/unit has a conftest module too, and a
``from conftest import ...`` run after both were loaded can get the other one.
"""

import json
import random

import pytest

from openpack.data.demo_tokenizer import build_demo_tokenizer
from saved_runs import save_tiny_llama, write_pairs, write_sort_prompts


@pytest.fixture(scope="session")
def tiny_pretrain(tmp_path_factory):
    """A random-init tiny Llama and the demo tokenizer, saved like any HF model."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=3, max_position_embeddings=256)


@pytest.fixture(scope="session")
def sft_jsonl(tmp_path_factory):
    """48 rows "reverse: <word>" -> "<reversed>", prompts and responses of 3 to 40 characters."""
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 40)))
        rows.append({"prompt": f"reverse: {word}\n", "response": word[::-1]})
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """Another tiny Llama (other seed): a reference that differs from the policy, as after SFT."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_ref"), seed=4, max_position_embeddings=256)


@pytest.fixture(scope="session")
def dpo_jsonl(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


@pytest.fixture(scope="session")
def ppo_models(tmp_path_factory):
    """A random tiny Llama policy, a tiny reward model (another random Llama with a value head and a saved
    normalisation, as train_rm --normalize_reward saves it), the demo tokenizer and prompts."""
    import torch

    from openpack.models.reward import load_reward_model, set_normalization

    root = tmp_path_factory.mktemp("ppo")
    tokenizer = build_demo_tokenizer()
    shape = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                 max_position_embeddings=256)
    save_tiny_llama(root / "model", seed=3, **shape)
    save_tiny_llama(root / "rm_base", seed=4, **shape)
    torch.manual_seed(5)
    rm = load_reward_model(str(root / "rm_base"), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        rm.score.weight.mul_(20)  # a random head's rewards are tiny; spread them so clipping and advantages bite
    set_normalization(rm.config, 0.1, 0.5)
    rm.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    write_sort_prompts(root / "prompts.jsonl")
    return root


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory):
    """A random tiny Llama vLLM can run (head_dim 32), the demo tokenizer, prompts and a rule reward."""
    root = tmp_path_factory.mktemp("rl")
    save_tiny_llama(root / "model", seed=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=256, max_position_embeddings=256)
    write_sort_prompts(root / "prompts.jsonl")
    (root / "reward.py").write_text("def reward(prompts, completions, rows):\n"
                                    "    return [c.count('a') + 0.5 * c.count('e') - 0.1 * len(c) for c in completions]\n")
    return root
