"""What one rank runs for ``openpack train_sft``, set up in dependency order.

process group -> tokenizer and model -> data -> micro-batcher -> DeepSpeed
engine -> resume -> tracker -> (demo: held-out accuracy) -> train -> final
model -> (demo: accuracy again). The same function runs in one process, under
torchrun, or in a Ray actor; it reads its rank from the process group.

The config objects are the ``train_sft`` command's dataclasses, read by
attribute only (this layer never imports the CLI).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import asdict
from pathlib import Path

import torch

from openpack.core.batch import Segment
from openpack.data.loading import DataError, load_rows
from openpack.data.sft import tokenize_sft
from openpack.distributed.checkpoint import load_checkpoint, save_checkpoint, save_hf_model
from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine
from openpack.distributed.process import barrier, init_distributed
from openpack.models.attention import set_attention_backend
from openpack.models.packed import PackedCausalLM
from openpack.trainers import demo
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.sft import LoopConfig, Position, total_steps, train, train_step
from openpack.trainers.tracking import Tracker

logger = logging.getLogger("openpack")


def run_sft(model_cfg, data_cfg, train_cfg, out_cfg, save_config=None) -> int:
    dist = init_distributed()
    logging.basicConfig(level=logging.INFO if dist.is_main else logging.WARNING, format="%(message)s")
    set_attention_backend(model_cfg.attn_backend)
    torch.manual_seed(train_cfg.seed)
    save_path = Path(out_cfg.save_path)
    is_demo = model_cfg.pretrain is None
    tokenizer, model = demo.tokenizer_and_model(model_cfg, train_cfg.seed)
    model.to(dist.device)

    datasets = data_cfg.dataset or demo.write_sft_data(save_path, dist.is_main)
    barrier()
    rows = load_rows(datasets, data_cfg.dataset_probs, train_cfg.seed, data_cfg.skip_bad_samples)
    if data_cfg.max_samples is not None:
        rows.rows, rows.sources = rows.rows[:data_cfg.max_samples], rows.sources[:data_cfg.max_samples]
    samples, report = tokenize_sft(
        rows, tokenizer, data_cfg.input_key, data_cfg.output_key, data_cfg.apply_chat_template,
        data_cfg.max_len, data_cfg.overlength_policy, data_cfg.skip_bad_samples,
    )
    skipped = dict(rows.skipped + report.skipped) or "none"
    logger.info("data: %d samples (%d truncated, %d dropped over --max_len %d; skipped: %s)",
                len(samples), report.truncated, report.dropped, data_cfg.max_len, skipped)

    batcher = MicroBatcher(
        segments=lambda i: [Segment(samples[i].tokens, samples[i].targets, sample_index=i)],
        group_lengths=[(len(s.tokens),) for s in samples],
        world_size=dist.world_size,
        packing_samples=train_cfg.packing_samples,
        max_tokens_per_gpu=train_cfg.max_tokens_per_gpu if train_cfg.use_dynamic_batch else None,
        micro_batch_size=train_cfg.micro_train_batch_size,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    loop = LoopConfig(train_cfg.train_batch_size, train_cfg.max_epochs, train_cfg.max_steps, train_cfg.seed,
                      out_cfg.logging_steps, out_cfg.save_steps)
    steps = total_steps(len(samples), loop)
    if steps == 0:
        raise DataError(f"{len(samples)} samples make no full step of --train_batch_size {loop.train_batch_size}; "
                        "lower --train_batch_size or add data")

    engine = create_engine(PackedCausalLM(model), optim_config(train_cfg, steps), zero_config(model_cfg),
                           dist.world_size)
    ckpt_path = Path(out_cfg.ckpt_path or save_path / "checkpoints")
    position = Position()
    if out_cfg.load_checkpoint:
        state = load_checkpoint(engine, ckpt_path)
        if state is not None:
            position = Position(**{k: state[k] for k in ("epoch", "step_in_epoch", "global_step")})
            logger.info("resumed from %s at step %d", ckpt_path, position.global_step)

    if dist.is_main and save_config is not None:
        save_config(save_path / "config.yaml")
    tracker = Tracker(str(save_path), steps, enabled=dist.is_main, use_wandb=out_cfg.use_wandb,
                      wandb_project=out_cfg.wandb_project, wandb_run_name=out_cfg.wandb_run_name,
                      use_tensorboard=out_cfg.use_tensorboard, resume=position.global_step > 0)
    with tracker:
        if is_demo:
            _report_accuracy(tracker, position.global_step, "before", demo.accuracy(model, tokenizer))

        def save(at: Position) -> None:
            save_checkpoint(engine, tokenizer, ckpt_path, at.global_step, asdict(at), out_cfg.max_ckpt_num, dist.is_main)

        engine.train()
        step = functools.partial(train_step, engine, batcher, dist=dist)
        position = train(step, len(samples), loop, tracker, save, position)
        save_hf_model(engine, tokenizer, save_path / "model", dist.is_main)
        tracker.message(f"model saved to {save_path / 'model'}")
        if is_demo:
            _report_accuracy(tracker, position.global_step, "after", demo.accuracy(model, tokenizer))
    return 0


def _report_accuracy(tracker, step: int, when: str, accuracy: float) -> None:
    tracker.message(f"held-out exact match {when} training: {accuracy:.1%}")
    tracker.log(step, {"eval_exact_match": accuracy})


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
