"""What integration tests read back from a run (metrics, weights) and compare, and the models and data they write."""

import json
import random

import torch


# The sft_jsonl rows' prompts as written: the tests' lengths (--max_len, row caps) were set for them, and
# train_sft's default template (OpenRLHF's 'User: {}\nAssistant: ', issue 41) would add 18 tokens to each.
BARE_PROMPTS = ["--input_template", "None"]


def strict_json(line: str):
    """``line`` parsed as strict JSON: Python's ``NaN``/``Infinity`` extensions are refused (metrics.jsonl writes
    null for them), so every test that reads metrics checks that too."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant} in {line.strip()[:200]}")
    return json.loads(line, parse_constant=refuse)


def read_metrics(save_path):
    with open(f"{save_path}/metrics.jsonl") as f:
        return [strict_json(line) for line in f]


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


def assert_same_critic(a, b, atol=1e-5):
    """PPO's critic: per-step critic metrics (and the reward and KL coefficient it depends on) and its exported
    weights equal."""
    from safetensors.torch import load_file

    for x, y in zip(read_metrics(a), read_metrics(b)):
        for key in ("critic_loss", "critic_grad_norm", "values", "returns", "kl_coef", "reward"):
            assert abs(x[key] - y[key]) <= atol * max(1.0, abs(y[key])), (key, x, y)
    wa, wb = load_file(f"{a}/critic/model.safetensors"), load_file(f"{b}/critic/model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


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


def save_tiny_llama(path, seed, arch="llama", **shape):
    """A random-init tiny Llama (or another ``models.tiny`` arch; ``shape``: config overrides) and the demo
    tokenizer, saved like any HF model."""
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.tiny import tiny_causal_lm

    tokenizer = build_demo_tokenizer()
    tiny_causal_lm(arch, seed=seed, vocab_size=len(tokenizer), **shape).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_sort_prompts(path, n=32, seed=0):
    """RL prompts "sort: <letters>", the sorted letters as ``label``, 3 to 20 letters."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 20)))
            f.write(json.dumps({"prompt": f"sort: {word}\n", "label": "".join(sorted(word))}) + "\n")
    return str(path)
