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
