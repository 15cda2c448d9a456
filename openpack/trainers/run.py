"""What every training command does around its step: engine, resume, tracking, checkpoints, final model.

A worker prepares its data and a step function; ``TrainingRun`` does the
rest in the same order for SFT and DPO: DeepSpeed engine -> resume from the
latest checkpoint -> config.yaml -> tracker -> steps (checkpointing every
``--save_steps`` and at the end) -> the final HF model in
``<save_path>/model``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from openpack.core.schedule import epoch_steps
from openpack.data.loading import DataError, Rows, load_rows
from openpack.distributed.checkpoint import load_checkpoint, save_checkpoint, save_hf_model
from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine
from openpack.distributed.process import DistInfo, init_distributed
from openpack.models.attention import set_attention_backend
from openpack.models.packed import PackedCausalLM
from openpack.trainers.tracking import Tracker

logger = logging.getLogger("openpack")


@dataclass
class LoopConfig:
    train_batch_size: int
    max_epochs: int
    max_steps: int | None
    seed: int
    logging_steps: int
    save_steps: int | None  # None: only at the end


@dataclass
class Position:
    """Where training stands; saved in checkpoints so a resumed run continues exactly here."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


def steps_per_epoch(num_samples: int, train_batch_size: int) -> int:
    return num_samples // train_batch_size


def total_steps(num_samples: int, loop: LoopConfig) -> int:
    full = steps_per_epoch(num_samples, loop.train_batch_size) * loop.max_epochs
    return min(full, loop.max_steps) if loop.max_steps else full


def run_steps(
    step: Callable[[list[int]], dict],
    num_samples: int,
    loop: LoopConfig,
    tracker,
    save: Callable[[Position], None],
    start: Position | None = None,
) -> Position:
    """Run ``step(sample_ids) -> metrics`` from ``start`` until max_epochs or max_steps.

    Shared by every trainer: the epoch order, the position a checkpoint
    resumes from, logging and ``save`` (a checkpoint at a position) live here.
    """
    position = start or Position()
    last = total_steps(num_samples, loop)
    while position.epoch < loop.max_epochs and position.global_step < last:
        steps = epoch_steps(num_samples, loop.train_batch_size, loop.seed, position.epoch)
        while position.step_in_epoch < len(steps) and position.global_step < last:
            metrics = step(steps[position.step_in_epoch])
            position.step_in_epoch += 1
            position.global_step += 1
            if position.global_step % loop.logging_steps == 0 or position.global_step == last:
                tracker.log(position.global_step, {"epoch": position.epoch, **metrics})
            if loop.save_steps and position.global_step % loop.save_steps == 0 and position.global_step < last:
                save(position)
        if position.step_in_epoch >= len(steps):
            position.epoch += 1
            position.step_in_epoch = 0
    save(position)
    return position


class TrainingRun:
    """One run of ``num_samples`` samples (or pairs) with the shared model, train and output flags."""

    def __init__(self, model, tokenizer, num_samples: int, model_cfg, train_cfg, out_cfg, dist: DistInfo,
                 save_config: Callable[[Path], None] | None = None):
        self.tokenizer, self.dist, self.num_samples, self.out_cfg = tokenizer, dist, num_samples, out_cfg
        self.save_path = Path(out_cfg.save_path)
        self.loop = LoopConfig(train_cfg.train_batch_size, train_cfg.max_epochs, train_cfg.max_steps,
                               train_cfg.seed, out_cfg.logging_steps, out_cfg.save_steps)
        steps = total_steps(num_samples, self.loop)
        if steps == 0:
            raise DataError(f"{num_samples} samples make no full step of --train_batch_size "
                            f"{self.loop.train_batch_size}; lower --train_batch_size or add data")
        self.engine = create_engine(PackedCausalLM(model), optim_config(train_cfg, steps), zero_config(model_cfg),
                                    dist.world_size)
        self.ckpt_path = Path(out_cfg.ckpt_path or self.save_path / "checkpoints")
        self.position = self._resume() if out_cfg.load_checkpoint else Position()
        if dist.is_main and save_config is not None:
            save_config(self.save_path / "config.yaml")
        self.tracker = Tracker(str(self.save_path), steps, enabled=dist.is_main, use_wandb=out_cfg.use_wandb,
                               wandb_project=out_cfg.wandb_project, wandb_run_name=out_cfg.wandb_run_name,
                               use_tensorboard=out_cfg.use_tensorboard, resume=self.position.global_step > 0)

    def _resume(self) -> Position:
        state = load_checkpoint(self.engine, self.ckpt_path)
        if state is None:
            return Position()
        position = Position(**{k: state[k] for k in ("epoch", "step_in_epoch", "global_step")})
        logger.info("resumed from %s at step %d", self.ckpt_path, position.global_step)
        return position

    def save(self, at: Position) -> None:
        save_checkpoint(self.engine, self.tokenizer, self.ckpt_path, at.global_step, asdict(at),
                        self.out_cfg.max_ckpt_num, self.dist.is_main)

    def train(self, step: Callable[[list[int]], dict]) -> Position:
        """Run the steps, then write the final model; returns where training ended."""
        self.engine.train()
        self.position = run_steps(step, self.num_samples, self.loop, self.tracker, self.save, self.position)
        save_hf_model(self.engine, self.tokenizer, self.save_path / "model", self.dist.is_main)
        self.tracker.message(f"model saved to {self.save_path / 'model'}")
        return self.position


def optim_config(train_cfg, steps: int) -> OptimConfig:
    return OptimConfig(
        learning_rate=train_cfg.learning_rate,
        weight_decay=train_cfg.weight_decay,
        adam_betas=tuple(train_cfg.adam_betas),
        lr_scheduler=train_cfg.lr_scheduler,
        warmup_steps=math.ceil(train_cfg.lr_warmup_ratio * steps),
        total_steps=steps,
        min_lr_ratio=train_cfg.min_lr_ratio,
        max_norm=train_cfg.max_norm,
    )


def zero_config(model_cfg) -> ZeroConfig:
    return ZeroConfig(model_cfg.zero_stage, model_cfg.bf16, model_cfg.adam_offload, model_cfg.param_offload)


def start_worker(model_cfg, seed: int) -> DistInfo:
    """Join the process group, set up logging (rank 0 talks), the attention backend and the seed."""
    dist = init_distributed()
    logging.basicConfig(level=logging.INFO if dist.is_main else logging.WARNING, format="%(message)s")
    set_attention_backend(model_cfg.attn_backend)
    torch.manual_seed(seed)
    return dist


def load_data_rows(datasets: list[str], data_cfg, seed: int) -> Rows:
    """The rows of --dataset (mixed by --dataset_probs), cut to --max_samples."""
    rows = load_rows(datasets, data_cfg.dataset_probs, seed, data_cfg.skip_bad_samples)
    if data_cfg.max_samples is not None:
        rows.rows, rows.sources = rows.rows[:data_cfg.max_samples], rows.sources[:data_cfg.max_samples]
    return rows
