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
import os
import sys
import types
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from openpack.distributed.nonfinite import DEFAULT_MAX_IN_A_ROW, StepGuard
from openpack.models.memory import MEMORY_TRACE, HeapTrimmer, mark_memory

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
    max_nonfinite_steps: int = DEFAULT_MAX_IN_A_ROW  # non-finite steps in a row that stop the run (nonfinite.py)


@dataclass
class ZeroConfig:
    stage: int
    bf16: bool
    offload_optimizer: bool
    offload_params: bool
    # ZeRO-3 leaves parameters smaller than this unpartitioned (DeepSpeed's default); tests set 0
    # so that even a tiny model's LM head is partitioned as a real one would be.
    param_persistence_threshold: int = 100_000


def deepspeed_config(zero: ZeroConfig, max_norm: float, world_size: int, num_params: int | None = None) -> dict:
    offload = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    zero_section = {"stage": zero.stage, "overlap_comm": False, "contiguous_gradients": True}
    if num_params is not None:
        bucket = bucket_elements(num_params)
        zero_section.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
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


def engine_stage(stage: int, world_size: int, device: torch.device, bf16: bool, offload: bool) -> int:
    """The ZeRO stage DeepSpeed runs for ``--zero_stage stage``: 0 for ZeRO-1/2 on one CPU rank in fp32 without
    offload, ``stage`` otherwise.

    On one rank ZeRO-1/2 partition nothing, yet ZeRO-2 copies each gradient into its reduce bucket and its
    partition in a hook after every parameter's backward, on every micro-batch, and ZeRO-1/2 copy the gradients
    once more into a flat fp32 tensor for the step. Stage 0 steps AdamW on the parameters' own gradients: the
    same update up to rounding (the clipping norm is summed in another order). A 9.8M Llama on CPU, 14
    micro-batches of 280 tokens a step: backward 2.35 -> 2.03 s a step, peak RSS 765 -> 714 MiB. Its checkpoint
    keeps the optimizer state in the model-states file, not in ZeRO's ``*optim_states.pt``, so a one-rank CPU
    checkpoint written before this (ZeRO's layout) cannot be resumed (``checkpoint.check_optimizer_layout``).
    GPUs keep the stage asked for: a colocated run moves ZeRO 1-3's states off the GPU while vLLM generates
    (``rl/colocation.py``), which stage 0 cannot; bf16 keeps DeepSpeed's ZeRO optimizer (stage 0 in bf16 is
    another optimizer, ``BF16_Optimizer``); offload needs ZeRO.
    """
    if stage in (1, 2) and world_size == 1 and device.type == "cpu" and not bf16 and not offload:
        return 0
    return stage


DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce and all-gather bucket, in elements


def bucket_elements(num_params: int) -> int:
    """ZeRO's reduce and all-gather bucket: DeepSpeed's default, but at most an eighth of the model.

    ZeRO-2 copies every gradient into its reduce bucket before reducing it; the bucket's memory is resident up
    to the gradients it has held, so a bucket larger than the model holds a full second copy of the gradients
    (538 MB on a 135M fp32 model; DeepSpeed's 5e8 elements is 2 GB in fp32). An eighth of the model bounds that
    to 1/8 of a copy, at 8 reductions a backward for a model under 4B parameters (issue 23). Bucketing only
    groups the element-wise sums, so the numbers are the same.
    """
    return max(1, min(DEEPSPEED_BUCKET, num_params // 8))


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


STEP_CHUNK = 1 << 22  # elements of a parameter AdamW steps at a time: its temporaries are one chunk (16 MB fp32)


class ChunkedAdamW(torch.optim.AdamW):
    """torch AdamW stepped over each parameter in chunks of ``chunk`` elements.

    ZeRO-1/2 hand AdamW one flat fp32 tensor per parameter group (every weight of the group), and torch's
    single-tensor step makes two temporaries of its size (``exp_avg_sq.sqrt() / bias_correction``): 8 bytes per
    parameter on top of the states at the step, +1 GB on a 132M model (measured on CPU). Stepped chunk by chunk,
    the temporaries are one chunk's, and each element sees the same arithmetic as in ``torch.optim.AdamW``'s
    single-tensor step (bitwise equal: ``tests/unit/test_chunked_adamw.py``); the state is AdamW's, so checkpoints
    are unchanged. Every DeepSpeed path steps it after taking the gradient norm, so it is where a non-finite step
    is skipped: ``guard`` (``nonfinite.StepGuard``) decides, and a skipped step changes nothing here.
    """

    def __init__(self, params, chunk: int = STEP_CHUNK, guard: StepGuard | None = None, **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.chunk, self.guard = chunk, guard

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.guard is not None and self.guard.skips():
            return loss  # a non-finite step: weights, moments and step counts stay as they were
        for group in self.param_groups:
            if group["amsgrad"] or group["capturable"] or group["differentiable"] or group["fused"]:
                raise ValueError("ChunkedAdamW steps plain AdamW only")
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch.optim.Adam._init_group makes it (its _get_scalar_dtype)
                    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                    state["step"] = torch.tensor(0.0, dtype=dtype)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                flat = [t.view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                for start in range(0, p.numel(), self.chunk):
                    part = [t[start:start + self.chunk] for t in flat]
                    adamw([part[0]], [part[1]], [part[2]], [part[3]], [], [state["step"].clone()],
                              foreach=False, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                              maximize=group["maximize"])
                state["step"] += 1
        return loss


class UpdateLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR that moves on with the updates applied: not for a step its optimizer's guard skipped (the schedule
    counts updates; ``nonfinite.py`` says why)."""

    def step(self, epoch=None):
        guard = getattr(self.optimizer, "guard", None)
        if guard is None or not guard.skips():
            super().step(epoch)


def _param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]  # LoRA trains no 1-D parameter; ZeRO drops empty groups


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _zero_supports_chunked_adamw() -> None:
    """List ``ChunkedAdamW`` among the optimizers ZeRO supports: it is torch AdamW (a subclass, the same step),
    which is on the list; unlisted, every engine start warns "You are using ZeRO with an untested optimizer"."""
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    if ChunkedAdamW not in ZERO_SUPPORTED_OPTIMIZERS:
        ZERO_SUPPORTED_OPTIMIZERS.append(ChunkedAdamW)


def _no_muon_import() -> None:
    """Stand in for DeepSpeed's Muon module, which openpack never uses.

    DeepSpeed imports it to ask whether the optimizer is Muon: in ZeRO's sanity check, at ZeRO-3 and bf16
    optimizer init, and in ZeRO-1/2's first gradient reduction. The import torch.compiles Muon's kernels:
    1.3-1.6 s and 40-190 MB of resident memory in every training process (measured on CPU, DeepSpeed 0.19.8).
    openpack's optimizer is always ``ChunkedAdamW``, so a module whose ``MuonWithAuxAdam`` nothing is an instance
    of gives DeepSpeed the same answers without the compile. Left alone when the real module is already imported.
    """
    if MUON_MODULE in sys.modules:
        return
    stand_in = types.ModuleType(MUON_MODULE, "openpack: DeepSpeed's Muon optimizer, never used (engine.py)")
    stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {"__doc__": "Never instantiated: openpack uses AdamW."})
    sys.modules[MUON_MODULE] = stand_in


def create_engine(module: torch.nn.Module, optim: OptimConfig, zero: ZeroConfig, world_size: int):
    """deepspeed.initialize with torch AdamW and a LambdaLR schedule stepped once per optimizer step."""
    import deepspeed

    if optim.lr_scheduler not in SCHEDULES:
        raise ValueError(f"--lr_scheduler must be one of {SCHEDULES}, got {optim.lr_scheduler!r}")
    guard = StepGuard(optim.max_nonfinite_steps)
    optimizer = ChunkedAdamW(
        _param_groups(module, optim.weight_decay), lr=optim.learning_rate, betas=optim.adam_betas,
        eps=optim.adam_epsilon, guard=guard
    )
    scheduler = UpdateLambdaLR(optimizer, lr_lambda(optim))
    _no_muon_import()
    _zero_supports_chunked_adamw()
    mark_memory("before engine init")
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(zero, optim.max_norm, world_size, trained),
    )
    _share_fp32_master(engine.optimizer)
    guard.engine, engine.step_guard = engine, guard
    if zero.stage == 0 and world_size == 1:
        engine.enable_backward_allreduce = False  # one rank: nothing to average, and it would copy every gradient
    if zero.stage == 3:
        gather_head_with_forward(engine.module)
    mark_memory("engine init")
    if engine.device.type == "cpu":
        _release_memory_after_steps(engine)
    if os.environ.get(MEMORY_TRACE):
        _trace_steps(engine)
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


def _release_memory_after_steps(engine) -> None:
    """CPU: the heap's free pages go back to the OS after a backward or optimizer step once the resident set grew
    by ``TRIM_MARGIN`` since the last trim (``HeapTrimmer``: a ZeRO-2 rank of SmolLM2-135M peaked 24% lower than
    never trimming). GPUs keep activations in PyTorch's caching allocator instead."""
    trim = HeapTrimmer()
    for name in ("backward", "step"):
        call = getattr(engine, name)

        def released(*args, _call=call, **kwargs):
            result = _call(*args, **kwargs)
            trim()
            return result

        setattr(engine, name, released)


def _trace_steps(engine, steps: int = 2) -> None:
    """``mark_memory`` after every forward, backward and optimizer step of the first ``steps`` steps."""
    done = {"steps": 0}

    def traced(name: str, call):
        def wrapper(*args, **kwargs):
            # DPO and RM call engine.step() after every micro-batch; only the one at the boundary updates
            updates = name != "optimizer step" or engine.is_gradient_accumulation_boundary()
            result = call(*args, **kwargs)
            if done["steps"] < steps and updates:
                mark_memory(f"step {done['steps'] + 1} {name}")
                done["steps"] += name == "optimizer step"
            return result
        return wrapper

    engine.forward = traced("forward", engine.forward)
    engine.backward = traced("backward", engine.backward)
    engine.step = traced("optimizer step", engine.step)


def _share_fp32_master(optimizer) -> None:
    """ZeRO-1/2 with fp32 weights: the optimizer's fp32 master partition becomes this rank's partition of the weights.

    DeepSpeed clones each rank's share of the flat weights into an fp32 master copy, steps AdamW on it, then
    copies it back into the weights; with fp32 weights that is a second copy of the same numbers (4 bytes a
    parameter: 538 MB on a 135M model). Pointing the master at the weights' own partition makes AdamW update
    the weights in place and the copy back a no-op (``copy_`` onto the same memory returns at once), so every
    number is the same. Offload, bf16 and ZeRO-0/3 keep DeepSpeed's own layout (no such attribute, or other
    dtypes or devices).
    """
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)
    partitions = getattr(optimizer, "parallel_partitioned_bit16_groups", None)
    if masters is None or partitions is None or getattr(optimizer, "cpu_offload", True):
        return
    import deepspeed.comm as ds_dist

    shared = False
    for group, master in enumerate(masters):
        own = partitions[group][ds_dist.get_rank(group=optimizer.real_dp_process_group[group])]
        if (own.dtype, own.device, own.shape) == (master.dtype, master.device, master.shape):
            master.data = own.data
            shared = True
    if shared:  # the fp32 views DeepSpeed keeps per parameter (_hp_mapping) still point at the old copies
        optimizer._link_all_hp_params()


def optimizer_step(engine, loss: torch.Tensor | None = None) -> torch.Tensor | float:
    """``engine.step()`` at a step boundary; returns the global gradient norm before clipping, unread.

    DeepSpeed reports the norm from its ZeRO and bf16 optimizers (a device
    tensor); without one (ZeRO-0 in fp32) it reports None, so the norm is
    taken from the already-averaged gradients before they are applied. It is
    returned as it is: reading it (``float``) waits for the device, which the
    step leaves to the logged steps (``trainers/metrics.py``).

    ``loss``: this rank's share of the step's loss (a device scalar). With it the update is applied only if the
    loss over every rank and the norm are finite (``nonfinite.StepGuard``: one host read; ``engine.step_guard``
    counts the skips, and raises ``NonFiniteStop`` after --max_nonfinite_steps of them in a row).
    """
    own_norm = None
    if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        own_norm = torch.nn.utils.get_total_norm(grads)
    if loss is not None:
        engine.step_guard.arm(loss, own_norm)
    engine.step()
    engine.step_guard.settle()
    return own_norm if own_norm is not None else engine.get_global_grad_norm()
