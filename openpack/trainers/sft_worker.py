"""What one rank runs for ``openpack train_sft``, set up in dependency order.

process group -> tokenizer and model -> data -> micro-batcher -> the shared
run (engine, resume, tracker, checkpoints; ``trainers/run.py``) -> (demo:
held-out accuracy) -> train -> final model -> (demo: accuracy again). The same function runs in one process, under
torchrun, or in a Ray actor; it reads its rank from the process group.

The config objects are the ``train_sft`` command's dataclasses, read by
attribute only (this layer never imports the CLI).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from openpack.core.batch import Segment
from openpack.data.sft import tokenize_sft
from openpack.distributed.process import barrier
from openpack.trainers import demo
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.run import TrainingRun, load_data_rows, start_worker
from openpack.trainers.sft import train_step

logger = logging.getLogger("openpack")


def run_sft(model_cfg, data_cfg, train_cfg, out_cfg, save_config=None) -> int:
    dist = start_worker(model_cfg, train_cfg.seed)
    save_path = Path(out_cfg.save_path)
    is_demo = model_cfg.pretrain is None
    tokenizer, model = demo.tokenizer_and_model(model_cfg, train_cfg.seed)
    model.to(dist.device)

    datasets = data_cfg.dataset or demo.write_sft_data(save_path, dist.is_main)
    barrier()
    rows = load_data_rows(datasets, data_cfg, train_cfg.seed)
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
    run = TrainingRun(model, tokenizer, len(samples), model_cfg, train_cfg, out_cfg, dist, save_config)
    with run.tracker:
        if is_demo:
            _report_accuracy(run.tracker, run.position.global_step, "before", demo.accuracy(model, tokenizer))
        position = run.train(functools.partial(train_step, run.engine, batcher, dist=dist))
        if is_demo:
            _report_accuracy(run.tracker, position.global_step, "after", demo.accuracy(model, tokenizer))
    return 0


def _report_accuracy(tracker, step: int, when: str, accuracy: float) -> None:
    tracker.message(f"held-out exact match {when} training: {accuracy:.1%}")
    tracker.log(step, {"eval_exact_match": accuracy})

