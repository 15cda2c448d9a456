"""The DeepSpeed engine every trainer steps: ZeRO 0-3, optional offload, AdamW, LR schedule, clipping.

Micro-batches are single packed rows (``train_micro_batch_size_per_gpu`` 1)
and their number changes from step to step, so DeepSpeed's fixed gradient
accumulation count is set to 1 and the trainer marks the last micro-batch of
each step with ``set_gradient_accumulation_boundary``. The loss handed to
``backward`` is already normalised over the whole step, so DeepSpeed's own
1/GAS scaling is 1 and only its average over data-parallel ranks remains,
which the trainer undoes by multiplying by the world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class OptimConfig:
    learning_rate: float
    weight_decay: float
    adam_betas: tuple[float, float]
    lr_scheduler: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    max_norm: float
    adam_epsilon: float = 1e-8


@dataclass
class ZeroConfig:
    stage: int
    bf16: bool
    offload_optimizer: bool
    offload_params: bool
    # ZeRO-3 leaves parameters smaller than this unpartitioned (DeepSpeed's default); tests set 0
    # so that even a tiny model's LM head is partitioned as a real one would be.
    param_persistence_threshold: int = 100_000


def deepspeed_config(zero: ZeroConfig, max_norm: float, world_size: int) -> dict:
    offload = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    zero_section = {"stage": zero.stage, "overlap_comm": False, "contiguous_gradients": True}
    if zero.stage == 3:
        zero_section["stage3_param_persistence_threshold"] = zero.param_persistence_threshold
    if zero.offload_optimizer:
        zero_section["offload_optimizer"] = offload
    if zero.offload_params:
        zero_section["offload_param"] = offload
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": max_norm,
        "zero_optimization": zero_section,
        "bf16": {"enabled": zero.bf16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # plain torch AdamW also under offload: no compiled ops needed
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def lr_lambda(optim: OptimConfig):
    """Linear warmup, then cosine/linear decay to min_lr_ratio, or constant."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.lr_scheduler == "constant":
            return 1.0
        span = max(1, optim.total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.lr_scheduler == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor


def _param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]  # LoRA trains no 1-D parameter; ZeRO drops empty groups


def create_engine(module: torch.nn.Module, optim: OptimConfig, zero: ZeroConfig, world_size: int):
    """deepspeed.initialize with torch AdamW and a LambdaLR schedule stepped once per optimizer step."""
    import deepspeed

    if optim.lr_scheduler not in SCHEDULES:
        raise ValueError(f"--lr_scheduler must be one of {SCHEDULES}, got {optim.lr_scheduler!r}")
    optimizer = torch.optim.AdamW(
        _param_groups(module, optim.weight_decay), lr=optim.learning_rate, betas=optim.adam_betas,
        eps=optim.adam_epsilon
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim))
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(zero, optim.max_norm, world_size),
    )
    if zero.stage == 3:
        gather_head_with_forward(engine.module)
    return engine


def gather_head_with_forward(module: torch.nn.Module) -> None:
    """Under ZeRO-3, gather the LM head's weight whenever ``module`` runs forward.

    openpack's chunked head reads ``lm_head.weight`` outside ``lm_head.forward``. DeepSpeed gathers an untied
    head on that access, but a head tied to the input embeddings stayed partitioned (shape [0]: a
    ZeroDivisionError in the first forward, issue 23); registering it as an external parameter of the wrapper
    gathers it for the whole forward and backward, tied or not.
    """
    import deepspeed

    model = getattr(module, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        deepspeed.zero.register_external_parameter(module, head.weight)


def optimizer_step(engine) -> torch.Tensor | float:
    """``engine.step()`` at a step boundary; returns the global gradient norm before clipping, unread.

    DeepSpeed reports the norm from its ZeRO and bf16 optimizers (a device
    tensor); without one (ZeRO-0 in fp32) it reports None, so the norm is
    taken from the already-averaged gradients before they are applied. It is
    returned as it is: reading it (``float``) waits for the device, which the
    step leaves to the logged steps (``trainers/metrics.py``).
    """
    own_norm = None
    if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        own_norm = torch.nn.utils.get_total_norm(grads)
    engine.step()
    return own_norm if own_norm is not None else engine.get_global_grad_norm()
