"""Shared fixtures: a tiny saved model folder and a JSONL dataset with varied lengths, all offline.

Functions tests import live in ``saved_runs.py``, not here: tests/unit has a conftest module too, and a
``from conftest import ...`` run after both were loaded can get the other one.
"""

import json
import random

import pytest

from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.models.tiny import tiny_causal_lm
from saved_runs import write_pairs


@pytest.fixture(scope="session")
def tiny_pretrain(tmp_path_factory):
    """A random-init tiny Llama and the demo tokenizer, saved like any HF model."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = build_demo_tokenizer()
    model = tiny_causal_lm("llama", seed=3, vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


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
    path = tmp_path_factory.mktemp("tiny_ref")
    tokenizer = build_demo_tokenizer()
    tiny_causal_lm("llama", seed=4, vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def dpo_jsonl(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


@pytest.fixture(scope="session")
def ppo_models(tmp_path_factory):
    """A random tiny Llama policy, a tiny reward model (another random Llama with a value head and a saved
    normalisation, as train_rm --normalize_reward saves it), the demo tokenizer and prompts."""
    import json
    import random

    import torch

    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.reward import load_reward_model, set_normalization
    from openpack.models.tiny import tiny_causal_lm

    root = tmp_path_factory.mktemp("ppo")
    tokenizer = build_demo_tokenizer()
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128, max_position_embeddings=256)
    tiny_causal_lm("llama", seed=3, **shape).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    tiny_causal_lm("llama", seed=4, **shape).save_pretrained(root / "rm_base")
    torch.manual_seed(5)
    rm = load_reward_model(str(root / "rm_base"), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        rm.score.weight.mul_(20)  # a random head's rewards are tiny; spread them so clipping and advantages bite
    set_normalization(rm.config, 0.1, 0.5)
    rm.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(32):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 20)))
            f.write(json.dumps({"prompt": f"sort: {word}\n"}) + "\n")
    return root


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory):
    """A random tiny Llama vLLM can run (head_dim 32), the demo tokenizer, prompts and a rule reward."""
    import json
    import random

    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.tiny import tiny_causal_lm

    root = tmp_path_factory.mktemp("rl")
    tokenizer = build_demo_tokenizer()
    model = tiny_causal_lm("llama", seed=3, vocab_size=len(tokenizer), hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(32):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 20)))
            f.write(json.dumps({"prompt": f"sort: {word}\n", "label": "".join(sorted(word))}) + "\n")
    (root / "reward.py").write_text("def reward(prompts, completions, rows):\n"
                                    "    return [c.count('a') + 0.5 * c.count('e') - 0.1 * len(c) for c in completions]\n")
    return root
