"""Which model families pack exactly, and the one check that refuses the rest before anything loads.

Packing is exact when every sequence in a row sees what it would see alone. ``VERIFIED`` lists the families
``tests/unit/test_model_families.py`` proves that for (packed == one at a time, log-probs and gradients, fp32,
1e-5), with the features it switches on. ``check_model_family`` runs on the config alone (``config.json``),
from every command's input checks and again when a model loads: what cannot be made exact is refused there,
naming the feature and the fix.
"""

from __future__ import annotations

from openpack.models.errors import UnsupportedModelError

# model_type -> the features the family test switches on (docs/models.md shows this table).
VERIFIED = {
    "llama": "rope: default, llama3, yarn, dynamic NTK (per sequence); tied embeddings",
    "qwen2": "sliding window shorter than the row; QKV bias",
    "qwen3": "sliding window shorter than the row; q/k norm",
    "qwen3_moe": "mixture of experts, router aux loss",
    "mixtral": "mixture of experts, sliding window, router aux loss",
    "mistral": "sliding window shorter than the row",
    "gemma2": "final-logit and attention softcapping, alternating sliding-window layers",
    "gemma3_text": "final-logit softcapping, alternating sliding-window layers with their own rope",
    "phi3": "sliding window; longrope (per sequence)",
    "olmo2": "q/k norm, post-norm",
    "smollm3": "NoPE layers",
    "gpt_neox": "partial rotary (rotary_pct), parallel residual",
}

# Attention that openpack's packed kernels do not compute: a family using it would be silently wrong.
_ATTENTION_SINKS = ("gpt_oss",)
# Config fields that make logits differ from lm_head(hidden) in ways openpack's chunked LM head does not apply
# (Gemma's final_logit_softcapping it applies: ``models.packed.final_logit_softcap``).
LOGIT_TRANSFORMS = ("logit_scale", "output_multiplier_scale", "logits_scaling")


def supported_families() -> str:
    return ", ".join(sorted(VERIFIED))


def check_model_family(config, flag: str = "--pretrain", prefix_sharing: bool = False) -> None:
    """Refuse, from ``config`` alone, a model that openpack's packed forward cannot make exact."""
    from openpack.models.rope import check_rope

    model_type = getattr(config, "model_type", "?")
    name = ", ".join(getattr(config, "architectures", None) or [model_type])
    if not _dispatches_attention(config):
        raise UnsupportedModelError(
            f"{flag}: {name} ({model_type}) computes attention in its own code, not through transformers' "
            "AttentionInterface, so openpack cannot keep packed sequences apart; supported families: "
            f"{supported_families()}")
    if model_type in _ATTENTION_SINKS:
        raise UnsupportedModelError(f"{flag}: {name} ({model_type}) uses attention sinks, which openpack's packed "
                                    f"attention does not compute; supported families: {supported_families()}")
    for field in LOGIT_TRANSFORMS:
        if getattr(config, field, None) not in (None, 1, 1.0):
            raise UnsupportedModelError(f"{flag}: {name} sets config.{field}; openpack's chunked LM head computes "
                                        f"logits as hidden @ weight only; supported families: {supported_families()}")
    try:
        check_rope(config, prefix_sharing, flag)
    except ValueError as err:
        raise UnsupportedModelError(str(err)) from err


def _dispatches_attention(config) -> bool:
    """Whether transformers' class for this config calls attention through ``AttentionInterface``.

    Falcon, MPT, Bloom, GPT-J and others compute it themselves (``_supports_attention_backend`` False): loading one
    with openpack's implementation name failed with a raw ``KeyError: 'openpack_varlen'``. A config transformers
    does not map to a class (remote code) is let through to the loader, which names it.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for auto in (AutoModelForCausalLM, AutoModelForSequenceClassification):
        try:
            return bool(auto._model_mapping[type(config)]._supports_attention_backend)
        except KeyError:
            continue
    return True
