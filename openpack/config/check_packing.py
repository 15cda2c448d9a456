"""``openpack check_packing``: prove packing is exact on this machine before trusting a run.

Builds tiny random models (Llama, Qwen2, Mistral with an 8-token sliding
window by default; ``--archs`` takes any family of ``models.tiny.FAMILIES``),
or loads your own with ``--pretrain PATH``, on the chosen device and dtype,
runs one packed forward and backward through openpack's attention backend,
and compares log-probs and gradients with each segment run alone through
transformers' eager attention. Both
sides are also compared with an fp32 copy, so in bf16 the rule is "packing
adds no more error than bf16 itself": packed error <= tolerance + 2 x the
unpacked bf16 error. Exits 1 if any model fails; a model
family that cannot pack exactly is refused with exit 2 before it loads.

This module holds the command's one section; the first paragraph above is its ``--help`` description, and the
check itself is ``models.verify.check_arch``.
"""

from __future__ import annotations

from dataclasses import dataclass

from openpack.config.schema import ConfigError, arg
from openpack.models.attention import BACKENDS
from openpack.models.tiny import FAMILIES, TINY_ARCHS
from openpack.models.verify import DTYPES

DESCRIPTION = __doc__.split("\n\n")[0]
CHECKABLE = tuple(dict.fromkeys(TINY_ARCHS + tuple(FAMILIES)))


@dataclass
class CheckPackingConfig:
    archs: list[str] = arg(list(TINY_ARCHS), f"tiny architectures to check, of {', '.join(CHECKABLE)}")
    pretrain: str | None = arg(None, "a saved HF causal LM folder (or hub name) to check instead of the tiny ones")
    device: str = arg("auto", "cpu, cuda, or auto (cuda when available)")
    dtype: str = arg("float32", "model dtype", choices=list(DTYPES))
    attn_backend: str = arg("auto", "packed attention backend; auto picks by device and dtype", choices=BACKENDS)
    lengths: list[int] = arg([7, 13, 1, 20, 5, 2, 64, 31], "segment lengths packed into one row")
    tolerance: float = arg(1e-5, "allowed max abs error of log-probs and of gradients, relative to their largest "
                                 "magnitude when that exceeds 1")
    seed: int = arg(0, "seed for model weights and tokens")
    prefix_sharing: bool = arg(True, "also check a prefix-shared row (each prompt once, its completions after it: "
                                     "--prefix_sharing's layout), groups of a prompt and 3 completions from "
                                     "--lengths; skipped for rope types that refuse it")

    def validate(self):
        unknown = set(self.archs) - set(CHECKABLE)
        if unknown:
            raise ConfigError(f"--archs: unknown {sorted(unknown)}; choose from {list(CHECKABLE)}")
        if min(self.lengths) < 1:
            raise ConfigError("--lengths: every segment needs at least 1 token")


CONFIGS = (CheckPackingConfig,)  # what the command parses; tests check example scripts against it
