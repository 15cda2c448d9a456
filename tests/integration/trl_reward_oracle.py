"""TRL 1.16's real RewardTrainer as an oracle: the first optimizer step's loss, gradient and token ids.

``trl_first_step`` hands a saved causal LM folder (loaded by TRL itself as
``AutoModelForSequenceClassification``, ``num_labels=1``, fp32, eager attention)
and a list of preference rows to a ``RewardTrainer`` on CPU and runs
``trainer.train()`` for exactly one optimizer step over all the rows TRL keeps (on one torch thread):

    rows 0..n-1 --TRL tokenizes, filters by max_length--> kept rows, in order
    micro-batch k = kept rows [k*b, (k+1)*b)          (sequential sampler)
    gradient accumulation steps = ceil(kept / b)       (one step sees every row)

It reads back what the optimizer would have stepped on (gradients captured
before ``optimizer.step()``, no clipping), the loss TRL logs for that step, the
ids each sequence was fed with, the rewards per row and TRL's logged metrics.
The trade-off: going through ``train()`` rather than calling ``compute_loss``
(as ``test_trl_dpo_oracle.py`` does) runs a throwaway AdamW step and a trainer
set-up, but it also exercises TRL's column selection, collator and
gradient-accumulation scaling, which a packed trainer must reproduce. 8 pairs
on the tiny Llama, Qwen2 or Mistral: 0.9 s for a process's first call, 0.35 s
after; bitwise the same on every call.

TRL quirks this exposes (``test_trl_reward_oracle_harness.py`` pins each):

* plain text is ``prompt + chosen + eos_token`` concatenated as *text*, then
  tokenized with the tokenizer's own special tokens (the demo tokenizer adds none);
* the reward is read at the rightmost token that is not ``pad_token_id``: with
  pad == eos that is the token *before* the appended eos;
* with gradient accumulation each micro-batch's loss is its own mean divided by
  the number of micro-batches, so uneven micro-batches weigh pairs unequally.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from unittest import mock

import torch

ROW_COLUMN = "_oracle_row"  # the input row index, carried through TRL's max_length filter


@dataclass(frozen=True)
class TrlRewardStep:
    """One RewardTrainer optimizer step. Per-row fields are in kept-row order (``kept``)."""

    loss: float  # the step's loss as TRL logs it: sum over micro-batches of (micro-batch loss / accumulation steps)
    grads: dict[str, torch.Tensor]  # d loss / d parameter for every parameter: "model.*" and "score.weight"
    chosen_ids: list[list[int]]  # the ids fed for each kept row's chosen sequence, padding stripped
    rejected_ids: list[list[int]]
    kept: list[int]  # indices into ``rows`` of the pairs TRL kept (it drops pairs longer than max_length)
    rewards_chosen: torch.Tensor  # (kept,) the reward TRL computed for each chosen sequence
    rewards_rejected: torch.Tensor  # (kept,)
    score_weight: torch.Tensor  # (1, hidden) the reward head the step started from
    micro_batches: list[list[int]]  # kept-row positions in each micro-batch
    metrics: dict[str, float]  # TRL's logged row: loss, accuracy, margin, min/mean/max_reward, num_tokens, grad_norm...

    @property
    def token_ids(self) -> list[tuple[list[int], list[int]]]:
        """(chosen ids, rejected ids) per kept row."""
        return list(zip(self.chosen_ids, self.rejected_ids))


def trl_first_step(
    model_dir: str,
    rows: list[dict],
    *,
    margin_key: str | None = None,
    center_rewards_coefficient: float | None = None,
    max_length: int | None = 1024,
    batch_size: int | None = None,
    seed: int = 42,
    score_weight: torch.Tensor | None = None,
    tokenizer=None,
) -> TrlRewardStep:
    """Run RewardTrainer for one optimizer step over ``rows`` (fp32, CPU) and return what it computed.

    ``margin_key`` names the rows' margin field (TRL reads a column called ``margin``; None: no margin,
    and a ``margin`` field is dropped). ``batch_size`` pairs per micro-batch (None: all kept rows in one).
    ``seed`` is ``RewardConfig.seed``: TRL calls ``set_seed(seed)`` before loading, so the head ``score`` is
    ``torch.manual_seed(seed); normal_(0, initializer_range)``; ``score_weight`` replaces it after loading.
    ``tokenizer`` defaults to the one saved in ``model_dir``; TRL may set its ``pad_token`` (to eos when unset).
    ``max_length`` is TRL's filter (None: no filter); a step with no pair left is an error.
    """
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import RewardConfig, RewardTrainer
        from trl.trainer.base_trainer import _BaseTrainer

    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_list([_trl_row(row, i, margin_key) for i, row in enumerate(rows)])
    capture = _StepCapture()

    class GradientsBeforeStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            capture.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}

    with tempfile.TemporaryDirectory(prefix="trl-reward-oracle-") as output_dir, warnings.catch_warnings(), \
            one_torch_thread():
        warnings.simplefilter("ignore")
        # Accumulation steps for all rows: if TRL's filter drops some, the loop fetches fewer micro-batches and
        # divides by the number it fetched (Trainer.current_gradient_accumulation_steps), as ceil(kept / b) would.
        per_micro_batch = batch_size or max(1, len(rows))
        accumulation_steps = math.ceil(len(rows) / per_micro_batch)
        args = RewardConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], seed=seed, data_seed=seed,
            max_length=max_length, center_rewards_coefficient=center_rewards_coefficient, max_steps=1,
            per_device_train_batch_size=per_micro_batch, gradient_accumulation_steps=accumulation_steps,
            max_grad_norm=0.0,  # no clipping: the captured gradient is d loss / d parameters
            gradient_checkpointing=False,  # TRL's default; the same numbers without dropout, minus the recompute
            train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataset_num_proc=None, model_init_kwargs={"attn_implementation": "eager"},
        )
        # No telemetry thread: the machine has no network, and a test must not try to reach one.
        with mock.patch.object(_BaseTrainer, "_send_telemetry", lambda self: None):
            trainer = RewardTrainer(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                                    callbacks=[GradientsBeforeStep()])
        kept = list(trainer.train_dataset[ROW_COLUMN])
        if not kept:
            raise ValueError(f"TRL kept none of the {len(rows)} rows at max_length={max_length}")
        model = trainer.model
        if score_weight is not None:
            with torch.no_grad():
                model.score.weight.copy_(score_weight)
        start_weight = model.score.weight.detach().clone()
        hook = model.register_forward_hook(capture.on_forward, with_kwargs=True)
        try:
            trainer.train()
        finally:
            hook.remove()
        (logged,) = [row for row in trainer.state.log_history if "loss" in row]
    return capture.result(kept, per_micro_batch, start_weight, logged)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread for the block. On 2 shared cores, 2 intra-op threads stall whenever another process
    holds a core: the same 16 tiny forwards and backward took 0.03 s on one thread, 0.1 to 11 s on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _trl_row(row: dict, index: int, margin_key: str | None) -> dict:
    """The row as TRL's dataset gets it: ``margin_key`` renamed to ``margin``, the row index added."""
    out = {key: value for key, value in row.items() if key not in ("margin", margin_key)}
    if margin_key is not None:
        out["margin"] = float(row[margin_key])
    out[ROW_COLUMN] = index
    return out


class _StepCapture:
    """What the model saw and returned in each micro-batch forward, and the gradients before the step."""

    def __init__(self):
        self.forwards = []  # (input_ids, attention_mask, rewards) per micro-batch, in order
        self.grads = None

    def on_forward(self, module, args, kwargs, output):
        self.forwards.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone(),
                              output.logits.detach().squeeze(-1).clone()))

    def result(self, kept, per_micro_batch, start_weight, logged) -> TrlRewardStep:
        chosen_ids, rejected_ids, rewards_c, rewards_r, micro_batches = [], [], [], [], []
        for input_ids, mask, rewards in self.forwards:
            half = input_ids.shape[0] // 2  # the collator stacks [chosen 0..b-1, rejected 0..b-1]
            ids = [row[: int(m.sum())].tolist() for row, m in zip(input_ids, mask)]
            start = len(chosen_ids)
            micro_batches.append(list(range(start, start + half)))
            chosen_ids += ids[:half]
            rejected_ids += ids[half:]
            rewards_c.append(rewards[:half])
            rewards_r.append(rewards[half:])
        assert len(chosen_ids) == len(kept) and len(micro_batches) == math.ceil(len(kept) / per_micro_batch), (
            "one optimizer step must see every kept row exactly once")
        assert self.grads is not None, "no optimizer step was taken"
        metrics = {key: float(value) for key, value in logged.items()}
        return TrlRewardStep(
            loss=metrics["loss"], grads=self.grads, chosen_ids=chosen_ids, rejected_ids=rejected_ids, kept=kept,
            rewards_chosen=torch.cat(rewards_c), rewards_rejected=torch.cat(rewards_r), score_weight=start_weight,
            micro_batches=micro_batches, metrics=metrics,
        )
