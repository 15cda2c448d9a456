"""What one rank runs for ``openpack train_dpo``, set up in dependency order.

process group -> tokenizer and policy -> pairs -> micro-batcher -> the
shared run (engine, resume, tracker, checkpoints; ``trainers/run.py``) ->
reference scorer (colocated model, or a cache built once and the model
freed) -> (demo: held-out preference accuracy and exact match) -> train ->
final model -> (demo again).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

from openpack.core.losses import LossParams, needs_reference
from openpack.data.preference import tokenize_pairs
from openpack.distributed.process import barrier
from openpack.models.loading import load_causal_lm, load_tokenizer
from openpack.models.packed import PackedCausalLM
from openpack.trainers import demo, reference
from openpack.trainers.batching import MicroBatcher
from openpack.trainers.dpo import PreferenceObjective, dpo_step
from openpack.trainers.run import TrainingRun, load_data_rows, start_worker

logger = logging.getLogger("openpack")


def run_dpo(model_cfg, data_cfg, train_cfg, out_cfg, dpo_cfg, demo_model=None, save_config=None) -> int:
    dist = start_worker(model_cfg, train_cfg.seed)
    pretrain = model_cfg.pretrain or str(demo_model)
    tokenizer = load_tokenizer(pretrain)
    model = load_causal_lm(pretrain, model_cfg.bf16, model_cfg.gradient_checkpointing).to(dist.device)

    datasets = data_cfg.dataset or demo.write_preference_data(Path(out_cfg.save_path), dist.is_main)
    barrier()
    rows = load_data_rows(datasets, data_cfg, train_cfg.seed)
    pairs, report = tokenize_pairs(rows, tokenizer, data_cfg.prompt_key, data_cfg.chosen_key, data_cfg.rejected_key,
                                   data_cfg.max_len, data_cfg.overlength_policy, data_cfg.skip_bad_samples)
    logger.info("data: %d pairs (%d truncated, %d dropped over --max_len %d; skipped: %s)", len(pairs),
                report.truncated, report.dropped, data_cfg.max_len, dict(rows.skipped + report.skipped) or "none")
    batcher = _batcher(pairs, train_cfg, dist, tokenizer)
    run = TrainingRun(model, tokenizer, len(pairs), model_cfg, train_cfg, out_cfg, dist, save_config)

    loss_types = list(dpo_cfg.loss_type) + (["sft"] if dpo_cfg.nll_loss_coef else [])
    weights = list(dpo_cfg.loss_weights or [1.0] * len(dpo_cfg.loss_type))
    weights += [dpo_cfg.nll_loss_coef] if dpo_cfg.nll_loss_coef else []
    params = LossParams(beta=dpo_cfg.beta, label_smoothing=dpo_cfg.label_smoothing, simpo_gamma=dpo_cfg.simpo_gamma)
    eval_pairs = demo.preference_eval_pairs(tokenizer) if demo_model is not None else None
    scorer, eval_ref = None, None
    if needs_reference(loss_types):
        scorer, eval_ref = _reference(dpo_cfg.ref_pretrain or pretrain, model_cfg, dpo_cfg, pairs, train_cfg, dist,
                                      tokenizer, eval_pairs)
    objective = PreferenceObjective(loss_types, weights, params, scorer)

    with run.tracker:
        if eval_pairs is not None:
            report_demo = functools.partial(_report_demo, run.tracker, model, tokenizer, eval_pairs, eval_ref,
                                            dpo_cfg.beta, _scoring_batcher(eval_pairs, train_cfg, dist, tokenizer), dist)
            report_demo(run.position.global_step, "before")
        position = run.train(functools.partial(dpo_step, run.engine, batcher, objective, dist=dist))
        if eval_pairs is not None:
            report_demo(position.global_step, "after")
    return 0


def _batcher(pairs, train_cfg, dist, tokenizer, dynamic_cap: int | None = None) -> MicroBatcher:
    cap = dynamic_cap or (train_cfg.max_tokens_per_gpu if train_cfg.use_dynamic_batch else None)
    return MicroBatcher(
        segments=lambda i: pairs[i].segments(i),
        group_lengths=[pair.lengths() for pair in pairs],
        world_size=dist.world_size,
        packing_samples=train_cfg.packing_samples or dynamic_cap is not None,
        max_tokens_per_gpu=cap,
        micro_batch_size=train_cfg.micro_train_batch_size,
        pad_token_id=tokenizer.pad_token_id or 0,
    )


def _reference(ref_name, model_cfg, dpo_cfg, pairs, train_cfg, dist, tokenizer, eval_pairs):
    """The reference scorer for training, and (demo) the reference log-probs of the held-out pairs."""
    ref_model = load_causal_lm(ref_name, model_cfg.bf16).to(dist.device)
    scorer = reference.ModelReference(
        reference.reference_engine(ref_model, model_cfg.zero_stage, dpo_cfg.ref_offload, model_cfg.bf16), dist.device)
    eval_ref = None
    if eval_pairs is not None:
        eval_ref = reference.score_dataset(scorer, _scoring_batcher(eval_pairs, train_cfg, dist, tokenizer),
                                           len(eval_pairs), dist)
    if dpo_cfg.ref_logps_cache is None:
        return scorer, eval_ref
    scoring = _scoring_batcher(pairs, train_cfg, dist, tokenizer)
    key = reference.cache_key(ref_name, _fingerprint(pairs))
    cached = reference.load_or_build_cache(dpo_cfg.ref_logps_cache, key, len(pairs),
                                           lambda: reference.score_dataset(scorer, scoring, len(pairs), dist), dist)
    reference.free(scorer)
    logger.info("reference log-probs cached in %s; reference model freed", dpo_cfg.ref_logps_cache)
    return cached, eval_ref


def _scoring_batcher(pairs, train_cfg, dist, tokenizer) -> MicroBatcher:
    """Whole-dataset packing for scoring: rows of the training cap (at least one pair's length)."""
    cap = max([train_cfg.max_tokens_per_gpu] + [sum(p.lengths()) for p in pairs])
    return _batcher(pairs, train_cfg, dist, tokenizer, dynamic_cap=cap)


def _fingerprint(pairs) -> str:
    digest = hashlib.sha256()
    for pair in pairs:
        digest.update(repr((pair.prompt, pair.chosen, pair.rejected)).encode())
    return digest.hexdigest()


def _report_demo(tracker, model, tokenizer, eval_pairs, eval_ref, beta, scoring, dist, step, when) -> None:
    """Held-out preference accuracy (implicit reward) and greedy exact match of the demo."""
    was_training = model.training
    policy = reference.score_dataset(reference.ModelReference(PackedCausalLM(model), dist.device), scoring,
                                     len(eval_pairs), dist)
    model.train(was_training)
    preference = demo.preference_accuracy(policy, eval_ref, beta)
    exact = demo.accuracy(model, tokenizer)
    tracker.message(f"held-out preference accuracy {when} training: {preference:.1%}; exact match: {exact:.1%}")
    tracker.log(step, {"eval_preference_accuracy": preference, "eval_exact_match": exact})
