"""What ``openpack train_dpo`` runs: the driver's plan (``plan_dpo``) and each rank's training (``run_dpo``).

driver: every pair's lengths (tokenized once, in parallel, or read from the
cache) -> plan every rank's steps from the lengths (and, for
--ref_logps_cache, each rank's share of one scoring pass). rank: process
group -> tokenizer and policy -> read and tokenize its own rows, by id -> the
shared run (engine, resume, tracker, checkpoints; ``trainers/run.py``) ->
reference scorer (colocated model, or a cache built once and the model
freed) -> (demo: held-out preference accuracy and exact match) -> train ->
final model -> (demo again).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from openpack.core.losses import LossParams, needs_reference
from openpack.core.schedule import RankPlan
from openpack.data.preference import PairTokenization, tokenize_pairs, warn_prompt_tails
from openpack.distributed.process import barrier
from openpack.models.loading import load_causal_lm, load_tokenizer
from openpack.models.lora import apply_lora
from openpack.models.packed import PackedCausalLM
from openpack.trainers import demo, reference
from openpack.trainers.batching import MicroBatcher, join_context, scoring_batches, warn_if_memory_short
from openpack.trainers.dpo import PreferenceObjective, dpo_step
from openpack.trainers.run import TrainingRun, finish_data, own_items, plan_ranks, select_data, start_worker

logger = logging.getLogger("openpack")


def plan_dpo(cfg, world_size: int, demo_model=None, is_main: bool = True) -> list[RankPlan]:
    """The driver's work: every rank's plan (``cfg``: the run's ``DPORunConfig``), from every pair's lengths."""
    data_cfg, train_cfg, dpo_cfg = cfg.data, cfg.train, cfg.dpo
    tokenizer = load_tokenizer(cfg.model.pretrain or str(demo_model))
    datasets = data_cfg.dataset or demo.write_preference_data(Path(cfg.output.save_path), is_main)
    barrier()  # torchrun: rank 0 wrote the demo data
    selection = select_data(datasets, tokenizer, tokenization(data_cfg), data_cfg, train_cfg.seed)
    scoring = dpo_cfg.ref_logps_cache is not None and needs_reference(dpo_cfg.losses()[0])
    return plan_ranks(finish_data(selection, data_cfg, warn_prompt_tails), datasets, train_cfg, world_size, scoring)


def run_dpo(cfg, demo_model=None, save_config=None, reference_group=None, plan: RankPlan | None = None) -> int:
    """One rank's training of the run ``cfg`` (its ``DPORunConfig``); ``plan`` is the driver's (Ray), or computed
    here (one process, torchrun).

    ``reference_group`` (Ray, --ref_num_nodes): reference actors elsewhere; ``scorer(rank)`` serves this rank.
    """
    model_cfg, data_cfg, train_cfg, dpo_cfg = cfg.model, cfg.data, cfg.train, cfg.dpo
    dist = start_worker(model_cfg, train_cfg.seed)
    pretrain = model_cfg.pretrain or str(demo_model)
    tokenizer = load_tokenizer(pretrain)
    model = load_causal_lm(pretrain, model_cfg.bf16, model_cfg.gradient_checkpointing,
                           load_in_4bit=model_cfg.load_in_4bit, aux_loss_coef=model_cfg.aux_loss_coef).to(dist.device)
    model = apply_lora(model, model_cfg)  # before the memory check: under LoRA only the adapters train
    own_reference = bool(model_cfg.lora_rank) and not dpo_cfg.ref_pretrain  # LoRA: the base is the reference
    colocated = needs_reference(dpo_cfg.losses()[0]) and reference_group is None and dpo_cfg.ref_logps_cache is None \
        and not own_reference
    context = join_context(train_cfg, model)  # --ring_attn_size: this rank's part of each row
    warn_if_memory_short(model, model_cfg, train_cfg, data_cfg.max_len, dist, segments_per_sample=2,
                         frozen_params=sum(p.numel() for p in model.parameters()) if colocated else 0)
    if plan is None:  # no driver (one process, torchrun): plan here
        plan = plan_dpo(cfg, dist.world_size, demo_model, dist.is_main)[dist.rank]
    how = tokenization(data_cfg)
    items = own_items(plan, lambda rows: tokenize_pair_rows(rows, tokenizer, how))  # this rank's rows only
    pairs = {i: how.segments(items[i], i) for i in plan.sample_ids()}  # prompt | chosen | rejected: --prefix_sharing
    batcher = MicroBatcher(pairs.__getitem__, train_cfg.packing_samples, tokenizer.pad_token_id or 0, context)
    run = TrainingRun(model, tokenizer, plan.steps, cfg, dist, save_config)

    loss_types, weights = dpo_cfg.losses()
    params = LossParams(beta=dpo_cfg.beta, label_smoothing=dpo_cfg.label_smoothing, simpo_gamma=dpo_cfg.simpo_gamma)
    eval_pairs = demo.preference_eval_pairs(tokenizer) if demo_model is not None else None
    eval_batches = scoring_batches(eval_pairs, train_cfg.max_tokens_per_gpu, dist) if eval_pairs is not None else None
    scorer, eval_ref = None, None
    if needs_reference(loss_types):
        adapters_off = reference.AdapterReference(run.engine, model, dist.device) if own_reference else None
        scorer, eval_ref = _reference(dpo_cfg.ref_pretrain or pretrain, model_cfg, dpo_cfg, plan, pairs, dist,
                                      eval_batches, eval_pairs, reference_group, adapters_off)
    objective = PreferenceObjective(loss_types, weights, params, scorer, fused=dpo_cfg.fused_loss)

    with run.tracker:
        if eval_pairs is not None:
            report_demo = functools.partial(_report_demo, run.tracker, model, tokenizer, eval_pairs, eval_ref,
                                            dpo_cfg.beta, eval_batches, dist)
            report_demo(run.position.global_step, "before")
        position = run.train(functools.partial(dpo_step, run.engine, batcher, objective, dist=dist))
        if eval_pairs is not None:
            report_demo(position.global_step, "after")
    return 0


def tokenization(data_cfg, margin_key: str | None = None) -> PairTokenization:
    """How this run's rows become pairs: the data section's flags (train_rm adds --margin_key)."""
    return PairTokenization(data_cfg.prompt_key, data_cfg.chosen_key, data_cfg.rejected_key, data_cfg.max_len,
                            data_cfg.overlength_policy, data_cfg.apply_chat_template, data_cfg.input_template,
                            margin_key, data_cfg.prefix_sharing)


def tokenize_pair_rows(rows, tokenizer, how: PairTokenization, skip_bad_samples: bool = False):
    """Rows as pairs; a rank's own rows (every one a pair in the driver) quietly: the driver warned."""
    return tokenize_pairs(rows, tokenizer, how.prompt_key, how.chosen_key, how.rejected_key, how.max_len,
                          how.overlength, skip_bad_samples, warn=False, apply_chat_template=how.apply_chat_template,
                          input_template=how.input_template, margin_key=how.margin_key)[0]


def build_reference(cfg, demo_model=None) -> reference.ModelReference:
    """What each actor of a separate reference group runs once (in its own process group): the frozen model."""
    model_cfg, dpo_cfg = cfg.model, cfg.dpo
    dist = start_worker(model_cfg, cfg.train.seed)
    return _reference_model(dpo_cfg.ref_pretrain or model_cfg.pretrain or str(demo_model), model_cfg, dpo_cfg, dist)


def _reference_model(ref_name, model_cfg, dpo_cfg, dist) -> reference.ModelReference:
    flag = "--ref_pretrain" if dpo_cfg.ref_pretrain else "--pretrain"  # an error names the flag the user gave
    ref_model = load_causal_lm(ref_name, model_cfg.bf16, flag=flag).to(dist.device)
    return reference.ModelReference(
        reference.reference_engine(ref_model, model_cfg.zero_stage, dpo_cfg.ref_offload, model_cfg.bf16), dist.device)


def _reference(ref_name, model_cfg, dpo_cfg, plan, pairs, dist, eval_batches, eval_pairs, reference_group,
               adapters_off=None):
    """The reference scorer for training, and (demo) the reference log-probs of the held-out pairs.

    ``adapters_off`` (LoRA without --ref_pretrain): the policy with its adapters disabled, unless the reference
    has its own actor group."""
    if reference_group is not None:
        scorer = reference_group.scorer(dist.rank)
    elif adapters_off is not None:
        scorer = adapters_off
    else:
        scorer = _reference_model(ref_name, model_cfg, dpo_cfg, dist)
    eval_ref = None
    if eval_pairs is not None:
        eval_ref = reference.score_dataset(scorer.segment_sums, eval_batches, len(eval_pairs), dist)
    if dpo_cfg.ref_logps_cache is None:
        return scorer, eval_ref
    key = reference.cache_key(ref_name, plan.fingerprint)
    batches = MicroBatcher(pairs.__getitem__, packing_samples=True).collate(plan.scoring)
    cached = reference.load_or_build_cache(dpo_cfg.ref_logps_cache, key, plan.num_samples,
                                           lambda: reference.score_dataset(scorer.segment_sums, batches, plan.num_samples, dist),
                                           dist)
    reference.free(scorer)
    logger.info("reference log-probs cached in %s; reference model freed", dpo_cfg.ref_logps_cache)
    return cached, eval_ref


def _report_demo(tracker, model, tokenizer, eval_pairs, eval_ref, beta, eval_batches, dist, step, when) -> None:
    """Held-out preference accuracy (implicit reward) and greedy answers of the demo."""
    was_training = model.training
    scorer = reference.ModelReference(PackedCausalLM(model), dist.device)
    policy = reference.score_dataset(scorer.segment_sums, eval_batches, len(eval_pairs), dist)
    model.train(was_training)
    preference = demo.preference_accuracy(policy, eval_ref, beta)
    rates = demo.accuracy(model, tokenizer)
    tracker.message(f"held-out {when} training: preference accuracy {preference:.1%}; {demo.describe(rates)}")
    tracker.log(step, {"eval_preference_accuracy": preference, **rates})
