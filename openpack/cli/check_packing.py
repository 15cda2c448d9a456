"""``openpack check_packing``: prove packing is exact on this machine before trusting a run.

Builds tiny random models (Llama, Qwen2, Mistral with an 8-token sliding
window) on the chosen device and dtype, runs one packed forward and backward
through openpack's attention backend, and compares log-probs and gradients
with each segment run alone through transformers' eager attention. Both
sides are also compared with an fp32 copy, so in bf16 the rule is "packing
adds no more error than bf16 itself": packed error <= tolerance + 2 x the
unpacked bf16 error. Exits 1 if any architecture fails.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

import torch

from openpack.cli.config import ConfigError, arg, parse_config
from openpack.models.attention import BACKENDS, resolve_backend, set_attention_backend
from openpack.models.tiny import TINY_ARCHS, tiny_causal_lm
from openpack.models.verify import packed_vs_unpacked, within_error_budget

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CheckPackingConfig:
    archs: list[str] = arg(list(TINY_ARCHS), "tiny architectures to check")
    device: str = arg("auto", "cpu, cuda, or auto (cuda when available)")
    dtype: str = arg("float32", "model dtype", choices=list(DTYPES))
    attn_backend: str = arg("auto", "packed attention backend; auto picks by device and dtype", choices=BACKENDS)
    lengths: list[int] = arg([7, 13, 1, 20, 5, 2, 64, 31], "segment lengths packed into one row")
    tolerance: float = arg(1e-5, "allowed max abs error of log-probs (and of gradients, relative to their scale)")
    seed: int = arg(0, "seed for model weights and tokens")

    def validate(self):
        unknown = set(self.archs) - set(TINY_ARCHS)
        if unknown:
            raise ConfigError(f"--archs: unknown {sorted(unknown)}; choose from {list(TINY_ARCHS)}")
        if min(self.lengths) < 1:
            raise ConfigError("--lengths: every segment needs at least 1 token")


CONFIGS = (CheckPackingConfig,)  # what the command parses; tests check example scripts against it


def check_arch(arch: str, cfg: CheckPackingConfig, device: torch.device) -> dict:
    model = tiny_causal_lm(arch, seed=cfg.seed).to(device)
    result = {"arch": arch, "device": str(device), "dtype": cfg.dtype, "backend": resolve_backend(device, DTYPES[cfg.dtype])}
    result.update(packed_vs_unpacked(model, cfg.lengths, seed=cfg.seed, dtype=DTYPES[cfg.dtype]))
    result["passed"] = within_error_budget(result, cfg.tolerance)
    return result


def main(argv: list[str] | None = None) -> int:
    try:
        (cfg,) = parse_config(argv, "openpack check_packing", __doc__.split("\n\n")[0], *CONFIGS)
    except ConfigError as err:
        print(f"openpack check_packing: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    set_attention_backend(cfg.attn_backend)
    results = [check_arch(arch, cfg, device) for arch in cfg.archs]
    for r in results:
        print(json.dumps(r))
    failed = [r["arch"] for r in results if not r["passed"]]
    verdict = f"NOT exact for {', '.join(failed)}" if failed else "exact"
    print(f"packed attention on {device} ({cfg.dtype}): {verdict} across {len(results)} architectures")
    return 1 if failed else 0
