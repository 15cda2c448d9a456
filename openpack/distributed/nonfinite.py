"""Non-finite steps: skipped on every rank and counted; several in a row stop the run; non-finite weights are never saved.

DeepSpeed's own skip is made for fp16's loss scaler. In bf16 and fp32 its ZeRO-1/2 (fp32 only) and ZeRO-3 skip a
step whose gradient norm is inf or NaN, but none of its paths looks at the loss, and stage 0 in fp32 (one CPU rank)
skips nothing: a NaN update is applied and then saved. So every engine carries a ``StepGuard`` that decides, once
per optimizer step and the same on every rank, before any weight moves:

    trainer:  last micro-batch's backward -> optimizer_step(engine, loss)   loss: this rank's share of the step's
      guard.arm(loss)        the share summed over ranks on the device (one rank's inf reaches every rank)
      engine.step()          DeepSpeed takes the global gradient norm, clips, then steps AdamW group by group
        ChunkedAdamW.step -> guard.skips()   reads [loss, norm] to the host (the step's one read), decides once;
                             a skipped step returns before AdamW touches a weight, a moment or its step count
        scheduler.step    -> skipped too
      guard.settle()         counts; decides here when DeepSpeed skipped the inner step itself (its inf-norm check)

The scheduler does not move on for a skipped step: the schedule counts updates, and a skipped step made none, so
the run goes on as a run that was never planned that step would (its samples are lost, not its learning rate;
``tests/integration/test_nonfinite.py`` compares the two to 1e-5). The decision is a host one (DeepSpeed's step,
the scheduler and the count run on the host), so it costs one host read per optimizer step, none per micro-batch;
DeepSpeed's ZeRO paths read the norm to the host at that point already (``is_invalid_grad_norm``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_IN_A_ROW = 3  # --max_nonfinite_steps none: a run stops after 3 non-finite steps in a row
FIXES = "a lower --learning_rate, a lower --max_norm (gradient clipping), fp32 (no --bf16)"


class NonFiniteStop(RuntimeError):
    """A run stopped by non-finite steps, or a save of non-finite weights refused; the message says where and what
    to try. The command exits 1 with it (``config/runner.py``)."""


class StepGuard:
    """One engine's decision, per optimizer step, to apply or skip the update; counts the skips and stops the run
    after ``max_in_a_row`` in a row (--max_nonfinite_steps). ``name`` ("policy", "critic") prefixes its lines;
    ``say`` prints a line (rank 0's console, set by ``TrainingRun``)."""

    def __init__(self, max_in_a_row: int = DEFAULT_MAX_IN_A_ROW, name: str = ""):
        self.max_in_a_row, self.name = max_in_a_row, name
        self.say: Callable[[str], None] = logger.warning
        self.engine = None  # set by create_engine: its optimizer reports the norm DeepSpeed took
        self.skipped = self.in_a_row = 0
        self.first_bad: int | None = None  # the step that began the current run of skips
        self.last_finite: tuple[int, float] | None = None  # (step, loss) of the last step applied
        self._pending: tuple[torch.Tensor, torch.Tensor | float | None] | None = None
        self._decision: bool | None = None  # this step's: True skips
        self._read: tuple[float, float] = (math.nan, math.nan)

    def arm(self, loss: torch.Tensor, norm: torch.Tensor | float | None = None) -> None:
        """Before ``engine.step()`` at a boundary: this rank's share of the step's loss (a device scalar; the shares
        of every rank add up to the step's loss), and the gradient norm where it is known already (stage 0, fp32)."""
        # a copy: a float64 share would come back as a view of the caller's sums, which the reduction would then
        # change in place (RL's logged loss read twice its value on 2 ranks)
        total = loss.detach().to(torch.float64).reshape(1).clone()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(total)  # on the device: inf or NaN anywhere makes the sum non-finite
        self._pending, self._decision = (total, norm), None

    def skips(self) -> bool:
        """Whether this step's update is skipped; decided at the first call of the step (the inner optimizer's,
        after DeepSpeed took the norm and before any update). Unarmed (an engine stepped directly): False."""
        if self._pending is None:
            return False
        if self._decision is None:
            total, norm = self._pending
            if norm is None:
                norm = getattr(self.engine.optimizer, "_global_grad_norm", None)
            self._decide(total, math.inf if norm is None else norm)
        return self._decision

    def _decide(self, total: torch.Tensor, norm: torch.Tensor | float) -> None:
        norm = torch.as_tensor(norm, dtype=torch.float64).reshape(1).to(total.device)
        loss, norm = torch.cat([total, norm]).tolist()  # the step's one host read
        self._read = (loss, norm)
        self._decision = not (math.isfinite(loss) and math.isfinite(norm) and norm >= 0)  # DeepSpeed's -1: inf

    def settle(self) -> bool:
        """After ``engine.step()``: True if the update was applied. Counts a skip, says it in one line, and raises
        ``NonFiniteStop`` on the ``max_in_a_row``-th skip in a row (every rank alike: the decision is global)."""
        if self._pending is None:
            return True
        if self._decision is None:  # DeepSpeed skipped the inner step itself: its norm was inf or NaN
            self._decide(self._pending[0], math.inf)
        skipped = self._decision or not self.engine.was_step_applied()
        self._pending, step = None, self.engine.global_steps  # DeepSpeed counts skipped steps too (and resumes it)
        loss, norm = self._read
        if not skipped:
            self.in_a_row, self.first_bad, self.last_finite = 0, None, (step, loss)
            return True
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        self.first_bad = self.first_bad or step
        where = f"{self.name} step" if self.name else "step"
        last = (f"the last finite loss was {self.last_finite[1]:.6g}, at {where} {self.last_finite[0]}"
                if self.last_finite else "no finite step yet in this run")
        self.say(f"{where} {step}: loss {loss:.6g}, gradient norm {norm:.6g}: not finite, the update is skipped "
                 f"on every rank ({self.in_a_row} in a row, {self.skipped} in all; {last})")
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteStop(
                f"{where} {step}: {self.in_a_row} steps in a row had a non-finite loss or gradient norm (from "
                f"{where} {self.first_bad} on; --max_nonfinite_steps {self.max_in_a_row}), so the run stops; nothing "
                f"of them was saved: the latest checkpoint is from before and no final model was written. Try "
                f"{FIXES}, or look at the samples of {where} {self.first_bad}, the first non-finite one")
        return False


def refuse_nonfinite(module: torch.nn.Module, what: str) -> None:
    """Raise ``NonFiniteStop`` on every rank if any weight of ``module`` is inf or NaN on any rank: the saver's own
    check, should a path above have missed a non-finite step. Each rank checks what it holds (under ZeRO-3 its
    partition, ``ds_tensor``), and one all-reduce makes the answer every rank's."""
    held = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    held = [t for t in held if t.numel() and t.is_floating_point()]
    bad = torch.tensor([float(sum(not bool(torch.isfinite(t).all()) for t in held))],
                       device=held[0].device if held else "cpu")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(bad)
    if bad.item():
        raise NonFiniteStop(f"refusing to save {what}: {int(bad.item())} of its weight tensors hold inf or NaN (the "
                            "run diverged). Try " + FIXES)
