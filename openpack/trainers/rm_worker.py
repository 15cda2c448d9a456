"""What ``openpack train_rm`` runs: the driver's plan (``plan_rm``) and each rank's training (``run_rm``).

driver: rows with every pair's lengths (tokenized once, in parallel, or read
from the cache) -> held-out split (``--eval_split_ratio``) -> plan every
rank's steps from the lengths (and, for ``--normalize_reward``, each rank's
share of one scoring pass). rank: process group -> tokenizer and reward
model (a causal LM gets a new value head) -> read and tokenize its own rows,
by id -> the shared run (engine, resume, tracker,
checkpoints; ``trainers/run.py``) -> held-out accuracy before, every
``--eval_steps`` and after -> (``--normalize_reward``: the training set's
reward mean and std into the config) -> the final model, a sequence
classifier ``AutoModelForSequenceClassification`` loads.

The config objects are the ``train_rm`` command's dataclasses, read by
attribute only (this layer never imports the CLI).
"""

from __future__ import annotations

import functools
import logging
import zlib
from pathlib import Path

import numpy as np
import torch

from openpack.core.reward_losses import reward_pair_losses
from openpack.core.schedule import RankPlan
from openpack.data.loading import load_rows
from openpack.data.prepared import Selection
from openpack.data.preference import warn_prompt_tails
from openpack.distributed.process import barrier
from openpack.models.loading import load_tokenizer
from openpack.models.lora import apply_lora
from openpack.models.reward import HEAD, PackedRewardModel, load_reward_model, rename_head, set_normalization
from openpack.trainers import demo
from openpack.trainers.batching import MicroBatcher, join_context, scoring_batches, warn_if_memory_short
from openpack.trainers.reference import score_dataset
from openpack.trainers.rm import RewardObjective, rm_step
from openpack.trainers.dpo_worker import tokenization as pair_tokenization, tokenize_pair_rows
from openpack.trainers.run import TrainingRun, finish_data, own_items, plan_ranks, select_data, start_worker

logger = logging.getLogger("openpack")


def plan_rm(cfg, world_size: int, demo_model=None, is_main: bool = True) -> list[RankPlan]:
    """The driver's work: every rank's plan (``cfg``: the run's ``RMRunConfig``), from every pair's lengths."""
    data_cfg, train_cfg, rm_cfg = cfg.data, cfg.train, cfg.rm
    tokenizer = load_tokenizer(cfg.model.pretrain or str(demo_model))
    datasets = data_cfg.dataset or demo.write_preference_data(Path(cfg.output.save_path), is_main,
                                                              demo.REWARD_SAMPLES, "rm_train.jsonl")
    barrier()  # torchrun: rank 0 wrote the demo data
    training, _ = _training_rows(datasets, tokenizer, data_cfg, rm_cfg, train_cfg.seed)
    return plan_ranks(finish_data(training, data_cfg, warn_prompt_tails), datasets, train_cfg, world_size,
                      scoring=rm_cfg.normalize_reward)


def _training_rows(datasets, tokenizer, data_cfg, rm_cfg, seed: int) -> tuple[Selection, Selection | None]:
    """The rows to train on, and the held-out rows ``--eval_split_ratio`` takes out of them (else None).

    A row is held out by a hash of its place among the loaded rows and the seed, so the driver and every rank
    split alike.
    """
    rows = select_data(datasets, tokenizer, pair_tokenization(data_cfg, rm_cfg.margin_key), data_cfg, seed)
    if not rm_cfg.eval_split_ratio:
        return rows, None
    held = np.array([zlib.crc32(f"{seed}:{i}".encode()) % 10_000 < rm_cfg.eval_split_ratio * 10_000
                     for i in range(len(rows))], dtype=bool)
    return rows.take(~held), rows.take(held)


def run_rm(cfg, demo_model=None, save_config=None, plan: RankPlan | None = None) -> int:
    """One rank's training of the run ``cfg`` (its ``RMRunConfig``); ``plan`` is the driver's (Ray), or computed
    here (one process, torchrun)."""
    model_cfg, data_cfg, train_cfg, out_cfg, rm_cfg = cfg.model, cfg.data, cfg.train, cfg.output, cfg.rm
    dist = start_worker(model_cfg, train_cfg.seed)
    pretrain = model_cfg.pretrain or str(demo_model)
    tokenizer = load_tokenizer(pretrain)
    model = load_reward_model(pretrain, model_cfg.bf16, model_cfg.gradient_checkpointing, rm_cfg.value_head_prefix,
                              tokenizer.pad_token_id, load_in_4bit=model_cfg.load_in_4bit).to(dist.device)
    model = apply_lora(model, model_cfg, head=HEAD)  # LoRA: adapters, and the value head trained in full
    context = join_context(train_cfg)  # --ring_attn_size: this rank's part of each row (no router loss trained)
    warn_if_memory_short(model, model_cfg, train_cfg, data_cfg.max_len, dist, segments_per_sample=2)
    if plan is None:  # no driver (one process, torchrun): plan here
        plan = plan_rm(cfg, dist.world_size, demo_model, dist.is_main)[dist.rank]
    how = pair_tokenization(data_cfg, rm_cfg.margin_key)
    items = own_items(plan, lambda rows: tokenize_pair_rows(rows, tokenizer, how))  # this rank's rows only
    pairs = {i: how.segments(items[i], i) for i in plan.sample_ids()}  # prompt | chosen | rejected: --prefix_sharing
    batcher = MicroBatcher(pairs.__getitem__, train_cfg.packing_samples, tokenizer.pad_token_id or 0, context)
    module = PackedRewardModel(model)
    run = TrainingRun(model, tokenizer, plan.steps, cfg, dist, save_config, module=module)
    margins = None
    if rm_cfg.margin_key:
        ids = plan.sample_ids()
        margins = torch.zeros(plan.num_samples)
        margins[ids] = torch.tensor([items[i].margin for i in ids])
    objective = RewardObjective(rm_cfg.loss, rm_cfg.center_rewards_coefficient, margins)

    held_out = _held_out_pairs(tokenizer, data_cfg, rm_cfg, train_cfg.seed, plan.datasets, demo_model is not None)
    evaluate = None
    if held_out:
        eval_batches = scoring_batches(held_out, train_cfg.max_tokens_per_gpu, dist)
        evaluate = functools.partial(_evaluate, run.engine, eval_batches, len(held_out), rm_cfg.loss, dist)
    step = functools.partial(rm_step, run.engine, batcher, objective, dist=dist)
    with run.tracker:
        if evaluate:
            _report(run.tracker, run.position.global_step, "before", evaluate())
            step = _with_evaluation(step, evaluate, rm_cfg.eval_steps, run.position.global_step, len(plan.steps))
        finish = functools.partial(_normalize, run.engine, model, pairs, plan, train_cfg, dist) \
            if rm_cfg.normalize_reward else None
        position = run.train(step, before_save=finish)
        if evaluate:
            _report(run.tracker, position.global_step, "after", evaluate())
    if rm_cfg.value_head_prefix != HEAD and dist.is_main:
        rename_head(Path(out_cfg.save_path) / "model", rm_cfg.value_head_prefix)
    return 0


def _held_out_pairs(tokenizer, data_cfg, rm_cfg, seed: int, datasets, is_demo: bool) -> list | None:
    """The pairs held-out accuracy is measured on: --eval_dataset, the --eval_split_ratio share, or the demo's."""
    if is_demo and not (rm_cfg.eval_dataset or rm_cfg.eval_split_ratio):
        return demo.preference_eval_pairs(tokenizer)
    if rm_cfg.eval_dataset:
        rows = load_rows(rm_cfg.eval_dataset, None, seed, data_cfg.skip_bad_samples)
    elif rm_cfg.eval_split_ratio:
        held = _training_rows(datasets, tokenizer, data_cfg, rm_cfg, seed)[1]
        rows = held.read() if len(held) else None
    else:
        return None
    how = pair_tokenization(data_cfg, rm_cfg.margin_key)
    return tokenize_pair_rows(rows, tokenizer, how, data_cfg.skip_bad_samples) if rows else None


def _evaluate(engine, batches, num_pairs: int, loss: str, dist) -> dict[str, float]:
    """Held-out pairwise accuracy (a tie counts half), margin and loss; every rank scores its share."""
    was_training = engine.module.training
    engine.eval()
    with torch.no_grad():
        chosen, rejected = score_dataset(lambda batch: engine(batch.to(dist.device)), batches, num_pairs, dist)
    engine.train(was_training)
    accuracy = ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean().item()
    return {"eval_accuracy": accuracy, "eval_margin": (chosen - rejected).mean().item(),
            "eval_loss": reward_pair_losses(chosen, rejected, loss).mean().item()}


def _with_evaluation(step, evaluate, every: int | None, start: int, total: int):
    """``step`` that also evaluates every ``every`` steps (not at the last: that one follows training)."""
    done = [start]

    def step_and_evaluate(planned):
        metrics = step(planned)
        done[0] += 1
        if every and done[0] % every == 0 and done[0] < total:
            metrics.update(evaluate())
        return metrics

    return step_and_evaluate


def _report(tracker, step: int, when: str, metrics: dict[str, float]) -> None:
    tracker.message(f"held-out pairwise accuracy {when} training: {metrics['eval_accuracy']:.1%} "
                    f"(margin {metrics['eval_margin']:.3f})")
    tracker.log(step, metrics)


def _normalize(engine, model, pairs, plan: RankPlan, train_cfg, dist) -> None:
    """--normalize_reward: the mean and std of every chosen and rejected reward of the training set, into the config."""
    engine.eval()
    batches = MicroBatcher(pairs.__getitem__, packing_samples=True).collate(plan.scoring)
    with torch.no_grad():
        chosen, rejected = score_dataset(lambda batch: engine(batch.to(dist.device)), batches, plan.num_samples, dist)
    rewards = torch.cat([chosen, rejected]).double()
    set_normalization(model.config, rewards.mean().item(), rewards.std().item())
    logger.info("reward normalisation from %d training rewards: mean %.4f, std %.4f", rewards.numel(),
                model.config.reward_mean, model.config.reward_std)
