"""What ``openpack train_sft`` runs: the driver's plan (``plan_sft``) and each rank's training (``run_sft``).

driver: tokenizer -> rows -> tokenize every row once -> plan every rank's
steps from the lengths. rank: process group -> tokenizer and model -> rows
-> tokenize its own samples -> the shared run (engine, resume, tracker,
checkpoints; ``trainers/run.py``) -> (demo: held-out accuracy) -> train ->
final model -> (demo: accuracy again). The same function runs in one
process, under torchrun (each rank then plans for itself), or in a Ray
actor; it reads its rank from the process group.

The config objects are the ``train_sft`` command's dataclasses, read by
attribute only (this layer never imports the CLI).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from openpack.core.batch import Segment
from openpack.core.schedule import RankPlan
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.sft import SFTSample, tokenize_sft
from openpack.distributed.process import barrier
from openpack.models.loading import load_tokenizer
from openpack.models.lora import apply_lora
from openpack.trainers import demo
from openpack.trainers.batching import MicroBatcher, join_context, warn_if_memory_short
from openpack.trainers.run import TrainingRun, load_data_rows, own_items, plan_ranks, start_worker
from openpack.trainers.sft import train_step

logger = logging.getLogger("openpack")


def plan_sft(cfg, world_size: int) -> list[RankPlan]:
    """The driver's work: every rank's plan (``cfg``: the run's ``SFTRunConfig``)."""
    return _tokenize_and_plan(cfg, world_size, is_main=True)[1]


def _tokenize_and_plan(cfg, world_size: int, is_main: bool) -> tuple[list[SFTSample], list[RankPlan]]:
    """Tokenize every row once (for lengths and bad-row errors) and plan each rank's steps."""
    data_cfg, train_cfg = cfg.data, cfg.train
    tokenizer = load_tokenizer(cfg.model.pretrain) if cfg.model.pretrain else build_demo_tokenizer()
    datasets = data_cfg.dataset or demo.write_sft_data(Path(cfg.output.save_path), is_main)
    barrier()  # torchrun: rank 0 wrote the demo data
    rows = load_data_rows(datasets, data_cfg, train_cfg.seed)
    samples, report = _tokenize(rows, tokenizer, data_cfg, data_cfg.skip_bad_samples)
    logger.info("data: %s", report.summary(len(samples), data_cfg.max_len, rows.skipped))
    return samples, plan_ranks(samples, _segments, datasets, train_cfg, world_size)


def run_sft(cfg, save_config=None, plan: RankPlan | None = None) -> int:
    """One rank's training of the run ``cfg`` (its ``SFTRunConfig``); ``plan`` is the driver's (Ray), or computed
    here (one process, torchrun)."""
    model_cfg, data_cfg, train_cfg = cfg.model, cfg.data, cfg.train
    dist = start_worker(model_cfg, train_cfg.seed)
    is_demo = model_cfg.pretrain is None
    tokenizer, model = demo.tokenizer_and_model(model_cfg, train_cfg.seed)
    model = apply_lora(model.to(dist.device), model_cfg)
    context = join_context(train_cfg, model)
    warn_if_memory_short(model, model_cfg, train_cfg, data_cfg.max_len, dist)
    if plan is None:  # no driver (one process, torchrun): plan here and keep what was just tokenized
        items, plans = _tokenize_and_plan(cfg, dist.world_size, dist.is_main)
        plan = plans[dist.rank]
    else:  # the driver's plan: tokenize only this rank's rows
        rows = load_data_rows(plan.datasets, data_cfg, train_cfg.seed)
        items = own_items(plan, rows, lambda subset: _tokenize(subset, tokenizer, data_cfg, False, warn=False)[0])
    samples = {i: _segments(items[i], i) for i in plan.sample_ids()}
    batcher = MicroBatcher(samples.__getitem__, train_cfg.packing_samples, tokenizer.pad_token_id or 0, context)
    run = TrainingRun(model, tokenizer, plan.steps, cfg, dist, save_config)
    with run.tracker:
        if is_demo:
            _report_accuracy(run.tracker, run.position.global_step, "before", demo.accuracy(model, tokenizer))
        position = run.train(functools.partial(train_step, run.engine, batcher, dist=dist, fused=train_cfg.fused_loss))
        if is_demo:
            _report_accuracy(run.tracker, position.global_step, "after", demo.accuracy(model, tokenizer))
    return 0


def _tokenize(rows, tokenizer, data_cfg, skip_bad_samples: bool, warn: bool = True):
    return tokenize_sft(rows, tokenizer, data_cfg.input_key, data_cfg.output_key, data_cfg.apply_chat_template,
                        data_cfg.max_len, data_cfg.overlength_policy, skip_bad_samples,
                        messages_key=data_cfg.messages_key, conversation_loss=data_cfg.conversation_loss,
                        input_template=data_cfg.prompt_template(), warn=warn)


def _segments(sample: SFTSample, index: int) -> list[Segment]:
    return [Segment(sample.tokens, sample.targets, sample_index=index)]


def _report_accuracy(tracker, step: int, when: str, rates: dict[str, float]) -> None:
    tracker.message(f"held-out {when} training: {demo.describe(rates)}")
    tracker.log(step, rates)
