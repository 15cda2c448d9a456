"""``openpack check_packing``: parse the flags, check every model's family, then compare each model's packed
forward and backward with its segments run alone (``models.verify.check_arch``), one JSON line per layout and a
verdict. Its flags and what they mean are in ``config/check_packing.py``."""

from __future__ import annotations

import json
import logging

import torch

from openpack.config.check_packing import CONFIGS, DESCRIPTION
from openpack.config.runner import refused
from openpack.config.schema import ConfigError, parse_config
from openpack.models.attention import set_attention_backend
from openpack.models.families import check_model_family
from openpack.models.loading import ModelLoadError
from openpack.models.tiny import tiny_config
from openpack.models.verify import check_arch, packing_verdict


def main(argv: list[str] | None = None) -> int:
    try:
        (cfg,) = parse_config(argv, "openpack check_packing", DESCRIPTION, *CONFIGS)
    except ConfigError as err:
        return refused("check_packing", err, 2)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    set_attention_backend(cfg.attn_backend)
    try:
        for arch in [] if cfg.pretrain else cfg.archs:  # every family first, before any model is built
            check_model_family(tiny_config(arch), f"--archs {arch}")
        results = [r for arch in ([None] if cfg.pretrain else cfg.archs) for r in check_arch(arch, cfg, device)]
    except ModelLoadError as err:
        return refused("check_packing", err, 2)
    for r in results:
        print(json.dumps(r))
    print(packing_verdict(results, device, cfg))
    return 0 if all(r["passed"] for r in results) else 1
