"""Shared fixtures: a tiny saved model folder and a JSONL dataset with varied lengths, all offline."""

import json
import random

import pytest
import torch

from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.models.tiny import tiny_causal_lm


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


def read_metrics(save_path):
    with open(f"{save_path}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def load_weights(save_path):
    from safetensors.torch import load_file

    return load_file(f"{save_path}/model/model.safetensors")


def assert_same_run(a, b, atol=1e-5):
    """Per-step losses and grad norms equal, and so are the final weights."""
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        assert abs(x["loss"] - y["loss"]) <= atol, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= atol * max(1.0, abs(y["grad_norm"])), (x, y)
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """Another tiny Llama (other seed): a reference that differs from the policy, as after SFT."""
    path = tmp_path_factory.mktemp("tiny_ref")
    tokenizer = build_demo_tokenizer()
    tiny_causal_lm("llama", seed=4, vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_pairs(path, n=48, seed=0):
    """Pairs "sort: <letters>" -> sorted (chosen) / one letter changed (rejected), 3 to 30 letters."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 30)))
        good = "".join(sorted(word))
        bad = good[:-1] + ("z" if good[-1] != "z" else "y")
        rows.append({"prompt": f"sort: {word}\n", "chosen": good, "rejected": bad})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def dpo_jsonl(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")
