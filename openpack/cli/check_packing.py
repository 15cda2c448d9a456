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
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

import torch

from openpack.config.schema import ConfigError, arg, parse_config
from openpack.models.attention import BACKENDS, resolve_backend, set_attention_backend
from openpack.models.families import check_model_family
from openpack.models.loading import ModelLoadError
from openpack.models.tiny import FAMILIES, TINY_ARCHS, tiny_causal_lm, tiny_config
from openpack.models.rope import length_dependent_rope
from openpack.models.verify import packed_vs_unpacked, shared_vs_unpacked, within_error_budget

CHECKABLE = tuple(dict.fromkeys(TINY_ARCHS + tuple(FAMILIES)))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_checked(arch: str | None, cfg: CheckPackingConfig):
    """The model to check: ``--pretrain`` in fp32 (the reference; refused before its weights load if its family
    cannot pack exactly), else the tiny ``arch``."""
    if arch is None:
        from openpack.models.loading import load_causal_lm

        return load_causal_lm(cfg.pretrain).eval()
    return tiny_causal_lm(arch, seed=cfg.seed)


def shared_groups(lengths: list[int]) -> list[tuple[int, list[int]]]:
    """--lengths as groups of a prompt and up to 3 completions: [7, 13, 1, 20, 5] -> [(7, [13, 1, 20]), (5, [])]."""
    return [(lengths[i], lengths[i + 1:i + 4]) for i in range(0, len(lengths), 4)]


def check_arch(arch: str | None, cfg: CheckPackingConfig, device: torch.device) -> list[dict]:
    """One result per layout checked: packed segments, then (``--prefix_sharing``) a prefix-shared row."""
    model = load_checked(arch, cfg).to(device)
    head = {"arch": arch or cfg.pretrain, "device": str(device), "dtype": cfg.dtype,
            "backend": resolve_backend(device, DTYPES[cfg.dtype])}
    results = [{**head, "layout": "packed", **packed_vs_unpacked(model, cfg.lengths, cfg.seed, DTYPES[cfg.dtype])}]
    groups = [g for g in shared_groups(cfg.lengths) if g[1]]
    if cfg.prefix_sharing and groups and length_dependent_rope(model.config) is None:
        results.append({**head, "layout": "prefix_shared",
                        **shared_vs_unpacked(model, groups, cfg.seed, DTYPES[cfg.dtype])})
    for result in results:
        result["passed"] = within_error_budget(result, cfg.tolerance)
    return results


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
    try:
        for arch in [] if cfg.pretrain else cfg.archs:  # every family first, before any model is built
            check_model_family(tiny_config(arch), f"--archs {arch}")
        results = [r for arch in ([None] if cfg.pretrain else cfg.archs) for r in check_arch(arch, cfg, device)]
    except ModelLoadError as err:
        print(f"openpack check_packing: {err}", file=sys.stderr)
        return 2
    for r in results:
        print(json.dumps(r))
    failed = list(dict.fromkeys(f"{r['arch']} ({r['layout']})" for r in results if not r["passed"]))
    verdict = f"NOT exact for {', '.join(failed)}" if failed else "exact"
    layouts = " and ".join(dict.fromkeys(r["layout"] for r in results))
    what = cfg.pretrain or f"{len({r['arch'] for r in results})} architectures"
    print(f"packed attention on {device} ({cfg.dtype}): {verdict} across {what} ({layouts} rows)")
    return 1 if failed else 0
