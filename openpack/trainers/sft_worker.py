"""What ``openpack train_sft`` runs: the driver's plan (``plan_sft``) and each rank's training (``run_sft``).

driver: tokenizer -> rows -> every row's lengths (tokenized once, in
parallel, or read from the cache) -> plan every rank's steps from the
lengths. rank: process group -> tokenizer and model -> read and tokenize
its own rows, by id -> the shared run (engine, resume, tracker,
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

from openpack.core.schedule import RankPlan
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.sft import SFTTokenization, tokenize_sft, warn_prompt_tails
from openpack.distributed.process import barrier
from openpack.models.loading import load_tokenizer
from openpack.models.lora import apply_lora
from openpack.trainers import demo
from openpack.trainers.batching import MicroBatcher, join_context, warn_if_memory_short
from openpack.trainers.run import TrainingRun, finish_data, own_items, plan_ranks, select_data, start_worker
from openpack.trainers.sft import train_step

logger = logging.getLogger("openpack")


def plan_sft(cfg, world_size: int, is_main: bool = True) -> list[RankPlan]:
    """The driver's work: every rank's plan (``cfg``: the run's ``SFTRunConfig``), from every row's lengths."""
    data_cfg, train_cfg = cfg.data, cfg.train
    tokenizer = load_tokenizer(cfg.model.pretrain) if cfg.model.pretrain else build_demo_tokenizer()
    datasets = data_cfg.dataset or demo.write_sft_data(Path(cfg.output.save_path), is_main)
    barrier()  # torchrun: rank 0 wrote the demo data
    selection = select_data(datasets, tokenizer, tokenization(data_cfg), data_cfg, train_cfg.seed)
    return plan_ranks(finish_data(selection, data_cfg, warn_prompt_tails), datasets, train_cfg, world_size)


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
    if plan is None:  # no driver (one process, torchrun): plan here
        plan = plan_sft(cfg, dist.world_size, dist.is_main)[dist.rank]
    items = own_items(plan, lambda rows: _tokenize(rows, tokenizer, data_cfg))  # this rank's rows only
    samples = {i: items[i].segments(i) for i in plan.sample_ids()}
    batcher = MicroBatcher(samples.__getitem__, train_cfg.packing_samples, tokenizer.pad_token_id or 0, context)
    run = TrainingRun(model, tokenizer, plan.steps, cfg, dist, save_config)
    with run.tracker:
        if is_demo:
            _report_accuracy(run.tracker, run.position.global_step, "before", demo.accuracy(model, tokenizer))
        position = run.train(functools.partial(train_step, run.engine, batcher, dist=dist, fused=train_cfg.fused_loss))
        if is_demo:
            _report_accuracy(run.tracker, position.global_step, "after", demo.accuracy(model, tokenizer))
    return 0


def tokenization(data_cfg) -> SFTTokenization:
    """How this run's rows become samples: the data section's flags (text prompts get ``prompt_template()``)."""
    return SFTTokenization(data_cfg.input_key, data_cfg.output_key, data_cfg.messages_key,
                           data_cfg.apply_chat_template, data_cfg.prompt_template(), data_cfg.max_len,
                           data_cfg.overlength_policy, data_cfg.conversation_loss)


def _tokenize(rows, tokenizer, data_cfg):
    """A rank's own rows, every one a sample in the driver: tokenized quietly (the driver warned)."""
    how = tokenization(data_cfg)
    return tokenize_sft(rows, tokenizer, how.input_key, how.output_key, how.apply_chat_template, how.max_len,
                        how.overlength, messages_key=how.messages_key, conversation_loss=how.conversation_loss,
                        input_template=how.input_template, warn=False)[0]


def _report_accuracy(tracker, step: int, when: str, rates: dict[str, float]) -> None:
    tracker.message(f"held-out {when} training: {demo.describe(rates)}")
    tracker.log(step, rates)
