"""Memory a training step needs, from the model config alone: warn before the first step, not after an OOM kill.

A packed micro-batch of T tokens keeps, per decoder layer and token, about
``10 h + 4 i + 4 kv`` numbers for the backward (h hidden, i MLP width, kv
the key/value width: the norms' inputs and outputs, q/k/v before and after
rotary, the attention output, the MLP's gate, up, activation and product).
Gradient checkpointing keeps only each layer's input (and the final norm's
and head's, 3 h) plus one layer's worth during its recompute. The chunked log-probs add one vocabulary-wide chunk of
logits, its softmax, and the LM head's fp32 gradient, whatever T is.
Measured on a Llama with SmolLM2-135M's widths (h 576, i 1536, kv 192) on
CPU in fp32: saved tensors 12,658 numbers per token and layer (formula
12,672); peak resident memory of a forward and backward within -13% to +18%
of the estimate for T = 1024-4096 and 8-16 layers
(``tests/unit/test_memory.py`` checks the formula against the tensors
autograd really saves).

Weights, gradients and AdamW states come on top: 4 + 4 + 8 bytes per
trained parameter in fp32, 2 + 2 + 12 in bf16 (fp32 master weights and
moments), the optimizer share divided over ranks from ZeRO-1, the gradients
from ZeRO-2 and the weights at ZeRO-3, and the optimizer moved off the device
with ``--adam_offload``. A frozen parameter (a LoRA base, a colocated
reference model) holds its weight only: LoRA at rank 16 on a 1.5B model
(~18M adapters) needs ~6.2 GB of states in fp32 instead of 24 GB.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1 << 30
MEMORY_TRACE = "OPENPACK_MEMORY_TRACE"  # a file: each process appends its resident memory at each phase's end


@dataclass
class StepMemory:
    """Bytes one rank needs: ``states`` (weights, gradients, optimizer), ``per_token`` of a micro-batch, and the
    chunked log-probs' ``logits_per_token`` (up to ``logits_cap``, one chunk) plus the LM head's gradient ``head``."""

    states: int
    per_token: int
    logits_per_token: int
    logits_cap: int
    head: int

    def total(self, tokens: int) -> int:
        return self.states + self.head + min(tokens * self.logits_per_token, self.logits_cap) + tokens * self.per_token

    def max_tokens(self, budget: int) -> int:
        return max(0, (budget - self.states - self.head - self.logits_cap) // self.per_token)

    def activation_tokens(self, budget: int) -> int:
        """The most tokens whose activations and logits chunk fit ``budget`` bytes."""
        tokens = budget // (self.per_token + self.logits_per_token)
        if tokens * self.logits_per_token > self.logits_cap:  # the logits stopped growing at one chunk
            tokens = (budget - self.logits_cap) // self.per_token
        return max(0, tokens)


def _widths(config) -> tuple[int, int, int, int, int]:
    """(layers, hidden, MLP width, key/value width, vocab) of a transformers decoder config."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return config.num_hidden_layers, hidden, intermediate, kv_heads * head_dim, config.vocab_size


def activation_numbers_per_token(config, gradient_checkpointing: bool = False) -> int:
    """Numbers autograd keeps per token of a packed row (see the module docstring)."""
    layers, hidden, intermediate, kv, _ = _widths(config)
    one_layer = 10 * hidden + 4 * intermediate + 4 * kv
    if gradient_checkpointing:  # each layer's input, the final norm's and head's (3 h), one layer recomputed
        return (layers + 3) * hidden + one_layer
    return layers * one_layer


def step_memory(config, num_params: int, bf16: bool, gradient_checkpointing: bool, zero_stage: int, world_size: int,
                adam_offload: bool = False, frozen_params: int = 0, chunk_elements: int = 1 << 26) -> StepMemory:
    """What one rank holds in a step: ``num_params`` trained (weights, gradients, AdamW states) and ``frozen_params``
    not (weights only: a LoRA model's base, a colocated reference model)."""
    width = 2 if bf16 else 4
    weights = (num_params + frozen_params) * width
    grads = num_params * width
    optimizer = 0 if adam_offload else num_params * (12 if bf16 else 8)
    shards = [world_size if zero_stage >= stage else 1 for stage in (3, 2, 1)]
    states = weights // shards[0] + grads // shards[1] + optimizer // shards[2]
    _, hidden, _, _, vocab = _widths(config)
    return StepMemory(states, activation_numbers_per_token(config, gradient_checkpointing) * width,
                      logits_per_token=2 * vocab * 4, logits_cap=2 * chunk_elements * 4, head=vocab * hidden * 4)


ROW_CAP = 16384  # the largest row an automatic cap picks: the offline commands' fixed --max_tokens_per_gpu
CPU_ACTIVATION_FLOOR = 128 << 20  # on CPU, rows whose activations stay under this are not split
ROW_ROOM = 4  # on CPU, a row has room for at least this many of the longest prompt + completion


def default_row_cap(need: StepMemory, unsharded_states: int, budget: int, cpu: bool, longest: int) -> tuple[int, str]:
    """RL's ``--max_tokens_per_gpu`` when none is given: (tokens, the bound that set them).

    A GPU's memory is its own: the row is what fits 90% of it after the states (``need``, this rank's share). A
    CPU shares RAM with everything else, and long rows train no faster there (a 9.8M Llama, forward and backward
    of one step's 3.9k tokens: 1.62 s in rows of 608 or 1216 tokens, 1.66 s in one row, but 1.86 s in rows of
    304): the row's activations are held to the size of the model's training states (``unsharded_states``:
    weights, gradients and AdamW moments on one rank), so they at most double what a step holds; but not below
    ``CPU_ACTIVATION_FLOOR``, where splitting saves little memory and costs a forward per row (the 0.46M demo
    model, a GRPO step of 1.7k tokens: 0.16 s of training in rows of 512, 0.13 s in one row, 34 MB apart); and
    with room for ``ROW_ROOM`` of the longest samples, as every row costs a forward and a backward (and, when
    measured, ZeRO-2's gradient copies, which one CPU rank no longer makes: ``engine.engine_stage``; 384-token
    prompts on the 9.8M model, one sample per 747-token row: training took 1.35x TRL's time, rows of 1792 tokens
    1.11x). Never more than ``ROW_CAP`` or the budget, never less than
    ``longest`` (one prompt and completion must fit).
    """
    why, cap = f"at most {ROW_CAP}", ROW_CAP
    if cpu:
        if unsharded_states >= CPU_ACTIVATION_FLOOR:
            held = need.activation_tokens(unsharded_states)
            bound = "the model's weights, gradients and optimizer states"
        else:
            held, bound = need.activation_tokens(CPU_ACTIVATION_FLOOR), f"{CPU_ACTIVATION_FLOOR >> 20} MiB on CPU"
        why_held = f"activations no larger than {bound}"
        if held < ROW_ROOM * longest:
            held, why_held = ROW_ROOM * longest, f"room for {ROW_ROOM} of the longest prompt + completion"
        if held < cap:
            why, cap = why_held, held
    fits = need.max_tokens(int(0.9 * budget))
    if fits < cap:
        why, cap = "90% of the device's memory", fits
    if cap < longest:
        return longest, f"the longest prompt + completion (tighter: {why}, {cap} tokens)"
    return cap, why


def device_memory(device: torch.device, ranks_on_device: int) -> int:
    """Bytes this rank may use: the GPU's total memory, or this machine's RAM shared by its local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * page_size // max(1, ranks_on_device)


def budget_warning(need: StepMemory, tokens: int, budget: int, token_flag: str, device: str,
                   checkpointed: StepMemory | None = None) -> str | None:
    """A one-paragraph warning when ``tokens`` per micro-batch cannot fit ``budget``; None when they fit.

    90% of the budget is the line: the allocator, the CUDA context or the OS need the rest.
    """
    if need.total(tokens) <= 0.9 * budget:
        return None
    fits = need.max_tokens(int(0.9 * budget))
    advice = [f"lower {token_flag} to about {fits}" if fits else "use more ranks or a larger ZeRO stage"]
    if checkpointed is not None:
        advice.append(f"pass --gradient_checkpointing ({checkpointed.per_token / 2**10:.0f} KiB per token instead of "
                      f"{need.per_token / 2**10:.0f})")
    return (f"memory: {token_flag} {tokens} needs about {need.total(tokens) / GIB:.1f} GiB on each rank "
            f"({need.per_token / 2**10:.0f} KiB of activations per token, {need.states / GIB:.1f} GiB of weights, "
            f"gradients and optimizer states) but {device} has {budget / GIB:.1f} GiB for it; the run will "
            f"probably be killed for lack of memory: {' or '.join(advice)}")


def mark_memory(phase: str) -> None:
    """With ``$OPENPACK_MEMORY_TRACE`` set: append this process's memory at the end of ``phase`` to that file.

    One JSON line: ``rss_mb`` (VmRSS now) and ``peak_mb`` (VmHWM: the peak since the previous mark, as each
    mark resets the high-water mark through ``/proc/self/clear_refs``), so a phase's own peak is visible
    even when an earlier one was higher. ``benchmarks/memory_real_model.py`` reads it; a no-op otherwise.
    """
    path = os.environ.get(MEMORY_TRACE)
    if not path:
        return
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    mib = {key: int(status[field].split()[0]) / 1024 for key, field in (("rss_mb", "VmRSS"), ("peak_mb", "VmHWM"))}
    record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "phase": phase, "time": time.time(), **mib}
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to VmRSS (Linux >= 4.0)
    except OSError:
        pass


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``); a no-op on other C libraries.

    CPU training calls it after a backward or optimizer step that grew the heap (``HeapTrimmer``). glibc serves
    allocations under its mmap threshold from the heap, and that threshold rises to 32 MiB after the first large
    free, so activations (4-13 MB tensors on a 576-wide model at 2048 tokens) come from the heap, which keeps
    what they free, fragmented: on SmolLM2-135M a ZeRO-2 reward-model rank peaked at 9137 MiB, 1.42x TRL's
    6454 MiB (issue 23). Trimming after each phase: 6971 MiB, 1.11x TRL, for about 6% more time a step.
    A fixed 1 MiB mmap threshold instead (every large tensor mapped and unmapped) gave 5510 MiB but 30% longer
    steps (minor page faults 0.8M -> 6.8M a step): rejected. Same run, same losses, each measured side by side.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


TRIM_MARGIN = 256 << 20


class HeapTrimmer:
    """``release_freed_memory`` when the resident set has grown by ``margin`` bytes since the last trim.

    A trim hands back every free page of the heap, and the next step faults them in again: on a tiny model (the
    agent demo's 0.4M-parameter SFT stage, a few MB of activations a step) trimming after every backward and step
    cost a third of the step's time (120 steps 24.3-25.4 s against 17.4-17.6 s, docs/verification.md). A step whose
    freed activations stay under the margin is never trimmed; one that frees more than the margin (SmolLM2's
    gigabytes) is trimmed as before, so a peak exceeds the always-trimmed one by about the margin at most.
    The floor follows the resident set down, so memory freed by other means does not hide growth.
    """

    def __init__(self, margin: int = TRIM_MARGIN):
        self.margin, self.floor, self.trims = margin, None, 0

    def __call__(self) -> None:
        rss = resident_bytes()
        if self.floor is not None and rss < self.floor + self.margin:
            self.floor = min(self.floor, rss)
            return
        release_freed_memory()
        self.trims += 1
        self.floor = resident_bytes()


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``: one read, 5 us on the 2-core Xeon); 0 without procfs."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
