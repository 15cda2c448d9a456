"""A tiny model vLLM's CPU backend accepts (head_dim 32: it refuses 16), saved with the demo tokenizer.

The demo model's shape (``openpack.trainers.demo.DEMO_MODEL``: hidden 128, 4 heads, 3 layers, 64 positions,
the 46-token demo vocabulary), so these tests also show the built-in default runs in vLLM.
"""

import torch

from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.models.tiny import tiny_causal_lm
from openpack.trainers.demo import DEMO_MODEL

PROMPTS = [[1, 5, 6, 7], [2, 9, 10, 11, 12, 13], [4, 20], [7, 7, 8, 9, 30, 31, 32]]


def demo_policy(seed: int = 0):
    """The demo's random-init tiny Llama with openpack's packed attention (fp32, eval mode)."""
    return tiny_causal_lm("llama", seed=seed, vocab_size=len(build_demo_tokenizer()), **DEMO_MODEL)


def save_demo_policy(path, seed: int = 0):
    """Save the demo policy and tokenizer as an HF folder vLLM can load; returns the model."""
    model = demo_policy(seed)
    model.save_pretrained(path)
    build_demo_tokenizer().save_pretrained(path)
    return model


@torch.no_grad()
def perturb(model, scale: float = 0.05, seed: int = 1):
    """Add seeded noise to every parameter, as a policy update would."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=generator) * scale)
