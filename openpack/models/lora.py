"""LoRA and QLoRA through peft: adapters on a loaded model, and the merged weights that leave the trainer.

``apply_lora`` wraps a model in a ``PeftModel`` whose LoRA layers replace the
targeted ``nn.Linear`` modules in place, so openpack's packed forward (which
calls ``get_decoder()`` and ``get_output_embeddings()``, forwarded by peft to
the wrapped model) runs through them: nothing in the packed path changes.
peft freezes every other weight, so the optimizer holds only the adapters
(and the reward head, ``modules_to_save``). A 1.5B model at rank 16 on every
linear layer trains ~18M parameters: AdamW state 0.2 GB instead of 18 GB.

Everything that leaves the trainer is the merged model, ``W + (alpha / r) B A``
under the base model's names, built one module at a time
(``merged_weights``): the final ``<save_path>/model`` (plain transformers
loads it; the adapter alone goes to ``<save_path>/adapter``) and the weights
pushed to vLLM. The sum is peft's own ``get_delta_weight``, so it equals
``merge_and_unload`` bit for bit.

QLoRA (``--load_in_4bit``) loads the frozen base in 4-bit NF4 through
bitsandbytes (CUDA only); merged weights are dequantised first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

ALL_LINEAR = "all-linear"  # peft's shorthand: every nn.Linear except the output layer (LM head / score head)


class LoRAUnavailable(ValueError):
    """--load_in_4bit asked for where it cannot run; the message names the flag and the fix."""


def check_4bit_available() -> None:
    """QLoRA needs bitsandbytes and a CUDA GPU; raise LoRAUnavailable, naming the fix, when either is missing."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise LoRAUnavailable("--load_in_4bit (QLoRA) needs bitsandbytes: pip install bitsandbytes, on a machine "
                              "with a CUDA GPU; or drop --load_in_4bit for LoRA on full-precision weights") from err
    if not torch.cuda.is_available():
        raise LoRAUnavailable("--load_in_4bit (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit kernels) and this "
                              "machine has none; drop --load_in_4bit for LoRA on full-precision weights")


def quantization_config(bf16: bool):
    """QLoRA's 4-bit NF4 with double quantisation (the QLoRA paper's and OpenRLHF's settings)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32)


def target_modules(names: list[str] | None) -> str | list[str]:
    """--target_modules as peft takes it: ['all-linear'] (the default) or none -> the 'all-linear' shorthand."""
    return ALL_LINEAR if not names or names == [ALL_LINEAR] else list(names)


def apply_lora(model, model_cfg, head: str | None = None):
    """``model`` with LoRA adapters (``--lora_rank`` > 0), else ``model`` unchanged.

    ``head``: a reward or value head (``score``) trained in full beside the adapters (peft's modules_to_save).
    """
    if not model_cfg.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=model_cfg.lora_dropout,
                        target_modules=target_modules(model_cfg.target_modules), bias="none",
                        task_type="SEQ_CLS" if head else "CAUSAL_LM", modules_to_save=[head] if head else None)
    model = get_peft_model(model, config)
    output = model.get_output_embeddings()
    if output is not None and hasattr(output, "lora_A"):
        raise ValueError(f"--target_modules {' '.join(model_cfg.target_modules)} puts adapters on the LM head, which "
                         "openpack's chunked log-probs read as a plain weight (the adapters would never train); "
                         "leave the output head out (all-linear does)")
    return model


def is_lora(model) -> bool:
    """Whether ``model`` is a peft-wrapped model (without importing peft when it is not)."""
    return type(model).__module__.startswith("peft.")


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model for the duration (peft's ``disable_adapter``), in eval mode; training mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield
    finally:
        model.train(was_training)


def merged_weights(model, zero_stage: int = 0, tied_aliases: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model name, detached tensor) of every weight of a peft model, LoRA merged in, in
    ``named_parameters`` order (so each decoder layer's weights stay together for vLLM's reload).

    'model.layers.0.self_attn.q_proj.weight' = base + scaling * B @ A; a ``modules_to_save`` head is its trained
    copy under the head's own name. A tied weight comes once, under its first name, unless ``tied_aliases``
    (weight sync: vLLM needs ``lm_head.weight`` of a tied model too). Under ZeRO-3 one module's parameters are
    gathered at a time; every rank must exhaust the iterator in the same order (the gathers are collective).
    """
    yield from _walk(model.get_base_model(), "", zero_stage, None if tied_aliases else set())


def merged_weight_names(model) -> list[str]:
    """The names ``merged_weights(model, tied_aliases=True)`` yields, in order, with nothing gathered or merged."""
    return [name for name, _ in _walk(model.get_base_model(), "", 0, None, names_only=True)]


def _walk(module, prefix: str, zero_stage: int, seen: set | None, names_only: bool = False):
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):
        module = module.modules_to_save[module.active_adapters[0]] if not module.disable_adapters \
            else module.original_module
    if isinstance(module, ParamWrapper):  # before LoraLayer, its base class: adapters on parameters, not a Linear
        yield from _merged_parameters(module, prefix, zero_stage, seen, names_only)
        return
    if isinstance(module, LoraLayer) and names_only:
        yield prefix + "weight", None
        if getattr(module.get_base_layer(), "bias", None) is not None:
            yield prefix + "bias", None
        return
    if isinstance(module, LoraLayer):
        with _gathered(list(module.parameters()), zero_stage):
            yield from _merged_layer(module, prefix)
        return
    own = [(name, p) for name, p in module.named_parameters(recurse=False) if seen is None or id(p) not in seen]
    if seen is not None:
        seen.update(id(p) for _, p in own)  # a tied weight once, under its first name (as named_parameters does)
    with _gathered([] if names_only else [p for _, p in own], zero_stage):
        for name, param in own:
            yield prefix + name, None if names_only else \
                param.data.detach().clone() if zero_stage == 3 else param.data.detach()
    for name, child in module.named_children():
        yield from _walk(child, f"{prefix}{name}.", zero_stage, seen, names_only)


def _merged_layer(layer, prefix: str):
    from peft.utils.integrations import dequantize_module_weight

    base = layer.get_base_layer()
    weight = dequantize_module_weight(base).data.detach()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    yield prefix + "weight", weight.clone()
    if getattr(base, "bias", None) is not None:
        yield prefix + "bias", base.bias.data.detach().clone()


def _merged_parameters(wrapper, prefix: str, zero_stage: int, seen: set | None, names_only: bool):
    """A module whose parameters carry LoRA (peft's ``ParamWrapper``): MoE experts stored as stacked 3-D weights
    (transformers 5's ``MixtralExperts``: ``gate_up_proj`` [experts, 2 x inter, hidden], ``down_proj``), which
    peft's all-linear targets through ``target_parameters``, one wrapper per parameter, nested. Each parameter is
    yielded under the experts module's own name, its wrapper's delta (``get_delta_weight``, the shape of the
    parameter, what peft's ``merge`` adds) added; the module has no ``weight`` for ``_merged_layer`` to read."""
    from peft.tuners.lora.layer import ParamWrapper

    deltas, base = {}, wrapper
    while isinstance(base, ParamWrapper):
        deltas[base.parameter_name] = base
        base = base.base_layer
    with _gathered([] if names_only else list(wrapper.parameters()), zero_stage):
        for name, param in base.named_parameters(recurse=False):
            if names_only:
                yield prefix + name, None
                continue
            weight, layer = param.data.detach(), deltas.get(name)
            for adapter in layer.active_adapters if layer is not None else ():
                if adapter in layer.lora_A:
                    weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
            yield prefix + name, weight.clone()
    for name, child in base.named_children():
        yield from _walk(child, f"{prefix}{name}.", zero_stage, seen, names_only)


def _gathered(params: list, zero_stage: int):
    if zero_stage != 3 or not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def save_merged(model, folder) -> None:
    """The merged model as a plain Hugging Face folder (``from_pretrained`` needs no peft); ZeRO-3 parameters
    must be gathered already (``save_hf_model`` does)."""
    base = model.get_base_model()
    config = base.config
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:  # QLoRA: the merged weights are dequantised, the folder is not 4-bit
        del config.quantization_config
    try:
        base.save_pretrained(folder, state_dict=dict(merged_weights(model)), safe_serialization=True)
    finally:
        if quantization is not None:
            config.quantization_config = quantization
