"""What every training command does around its step: engine, resume, tracking, checkpoints, final model.

The driver tokenizes every row once (or reads the lengths from the cache,
``data/prepared.py``) and plans every rank's steps from the lengths
(``plan_ranks``); a rank reads and tokenizes only its own rows, by id
(``own_items``). Without a driver (one process, torchrun) a rank plans
itself the same way. A worker prepares its data and a step function;
``TrainingRun`` does the rest in the same order for SFT and DPO: DeepSpeed
engine -> resume from the latest checkpoint -> config.yaml -> tracker ->
steps (checkpointing every ``--save_steps`` and at the end) -> the final HF
model in ``<save_path>/model``.

A resume continues the checkpoint's run exactly or not at all: the checkpoint
is verified against its manifest, then its world size and the digests of the
steps it took are compared with this run's plan (``check_resumable``), all
before DeepSpeed loads it. The run id (``run.json``, claimed here once every check has passed)
stamps every checkpoint, so pruning never deletes another run's.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import yaml

from openpack.core.schedule import RankPlan, plan_run, plan_scoring
from openpack.data.loading import DataError, Rows, open_datasets
from openpack.data.prepared import Prepared, Selection, select
from openpack.distributed.checkpoint import (RunState, check_resumable, decided_by_main, load_checkpoint,
                                             open_checkpoint, save_checkpoint, save_hf_model)
from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine, engine_stage
from openpack.distributed.nonfinite import DEFAULT_MAX_IN_A_ROW
from openpack.distributed.process import DistInfo, init_distributed
from openpack.distributed.save_path import checkpoint_dir, claim, resumes, tag_step
from openpack.models.attention import set_attention_backend
from openpack.models.memory import mark_memory
from openpack.models.packed import PackedCausalLM
from openpack.trainers.batching import batching, context_parallel_size
from openpack.trainers.tracking import Tracker


class PlannedStep(Protocol):
    """What the run loop needs of a planned step: where it stands, and a digest of what it trains on (a resume
    compares them). Offline trainers plan ``RankStep``s (``core/schedule.py``); online RL plans rollout batches
    (``rl/step.py``)."""

    epoch: int
    index: int  # the step's place in its epoch
    digest: str


Step = TypeVar("Step", bound=PlannedStep)


@dataclass
class Position:
    """Where training stands; saved in checkpoints so a resumed run continues exactly here."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


def plan_ranks(data: Prepared, datasets: list[str], train_cfg, world_size: int,
               scoring: bool = False) -> list[RankPlan]:
    """The driver's work: every rank's plan for the whole run, from the samples' lengths (``data``).

    ``scoring`` adds each rank's share of one pass over every sample (the reference cache).
    Under --ring_attn_size N the steps are planned for world / N data-parallel ranks, and ranks
    r N .. r N + N - 1 (one context group) all get data-parallel rank r's micro-batches.
    """
    ring = context_parallel_size(train_cfg)
    steps = plan_run(data.lengths, data.labels, world_size // ring, batching(train_cfg), train_cfg.train_batch_size,
                     train_cfg.max_epochs, train_cfg.max_steps, train_cfg.seed)
    steps = [steps[rank // ring] for rank in range(world_size)]
    if not steps[0]:
        raise DataError(f"{len(data.rows)} samples make no full step of --train_batch_size "
                        f"{train_cfg.train_batch_size}; lower --train_batch_size or add data")
    score = plan_scoring(data.lengths, world_size, train_cfg.max_tokens_per_gpu) if scoring else [None] * world_size
    return [RankPlan(steps[r], data.rows, data.fingerprint, datasets, score[r]) for r in range(world_size)]


def own_items(plan: RankPlan, tokenize: Callable[[Rows], list]) -> dict[int, object]:
    """Read and tokenize only the rows behind this rank's sample ids, by their global ids (``plan.rows``); the
    driver measured all of them once, for lengths."""
    ids = plan.sample_ids()
    items = tokenize(open_datasets(plan.datasets).read(plan.rows[ids]))
    if len(items) != len(ids):
        raise RuntimeError(f"{len(ids)} rows gave {len(items)} samples here but not in the driver: is the data "
                           "or the tokenizer different on this node?")
    return dict(zip(ids, items))


def run_steps(step: Callable[[Step], dict], steps: Sequence[Step], logging_steps: int, save_steps: int | None,
              tracker, save: Callable[[Position], None], start: Position | None = None) -> Position:
    """Run ``step(planned) -> metrics`` over the planned steps from ``start`` on.

    Shared by every trainer: the position a checkpoint resumes from, logging
    and ``save`` (a checkpoint at a position) live here.
    """
    position = start or Position()
    last = len(steps)
    for planned in steps[position.global_step:]:
        metrics = step(planned)
        position = Position(planned.epoch, planned.index + 1, position.global_step + 1)
        if position.global_step % logging_steps == 0 or position.global_step == last:
            tracker.log(position.global_step, {"epoch": planned.epoch, **metrics})
        if save_steps and position.global_step % save_steps == 0 and position.global_step < last:
            save(position)
    save(position)
    return position


class TrainingRun:
    """One run of this rank's planned steps with the shared model, train and output sections of the run config."""

    def __init__(self, model, tokenizer, steps: Sequence[PlannedStep], cfg, dist: DistInfo,
                 save_config: Callable[[Path], None] | None = None, module: torch.nn.Module | None = None,
                 optimizer_steps: int | None = None, companions: dict | None = None,
                 extra_state: Callable[[], dict] | None = None):
        """``cfg``: the run's config (its ``model``, ``train`` and ``output`` sections are read here);
        ``module`` wraps ``model`` for the engine (default ``PackedCausalLM``: per-token log-probs);
        ``optimizer_steps`` sizes the learning-rate schedule when a planned step holds several (online RL);
        ``companions`` (``name -> engine``, e.g. PPO's critic) are checkpointed and resumed with the policy;
        ``extra_state()`` adds to each checkpoint's client state (e.g. an adaptive KL coefficient), and a resume
        leaves the saved client state in ``self.resumed_state``."""
        model_cfg, train_cfg, out_cfg = cfg.model, cfg.train, cfg.output
        self.tokenizer, self.dist, self.steps, self.out_cfg = tokenizer, dist, steps, out_cfg
        self.companions, self.extra_state, self.resumed_state = companions or {}, extra_state, {}
        self.save_path = Path(out_cfg.save_path)
        self.engine = create_engine(module or PackedCausalLM(model), optim_config(train_cfg, optimizer_steps or len(steps)),
                                    zero_config(model_cfg, dist), dist.world_size)
        self.ckpt_path = checkpoint_dir(self.save_path, out_cfg.ckpt_path)
        self.notices: list[str] = []  # shown once the tracker (the console of rank 0) exists
        if self.engine.zero_optimization_stage() != model_cfg.zero_stage:
            self.notices.append(f"--zero_stage {model_cfg.zero_stage} on one CPU rank runs as DeepSpeed's stage 0 "
                                "(nothing to partition; the same update without ZeRO's gradient copies)")
        # The claim comes here, after the model, the data and the engine: a run refused by any check leaves
        # no run.json behind (issue 23). The CLI already refused a folder holding another run's files.
        self.run_id = decided_by_main(lambda: claim(self.save_path, self.ckpt_path, resumes(out_cfg),
                                                    out_cfg.overwrite, say=self.notices.append).run_id)
        pending = self.save_path / ".config.yaml.new"  # becomes config.yaml once a resume is known to be exact
        self.config = self._effective_config(save_config, pending)
        try:
            self.position = self._resume() if resumes(out_cfg) else Position()
        except BaseException:
            if self.config is not None:
                pending.unlink(missing_ok=True)
            raise
        if self.config is not None:
            os.replace(pending, self.save_path / "config.yaml")
        self.tracker = Tracker(str(self.save_path), len(steps), enabled=dist.is_main, use_wandb=out_cfg.use_wandb,
                               wandb_project=out_cfg.wandb_project, wandb_run_name=out_cfg.wandb_run_name,
                               use_tensorboard=out_cfg.use_tensorboard, resume_step=self.position.global_step,
                               run_id=self.run_id)
        for notice in self.notices:
            self.tracker.message(notice)
        for engine in (self.engine, *self.companions.values()):  # a skipped step's line, on rank 0's console
            engine.step_guard.say = self.tracker.message

    def _effective_config(self, save_config, pending: Path) -> dict | None:
        """Rank 0: the config this run saves (config.yaml), written to ``pending``; None elsewhere."""
        if not self.dist.is_main or save_config is None:
            return None
        save_config(pending)
        return yaml.safe_load(pending.read_text())

    def _state(self, steps_taken: int) -> RunState:
        return RunState(self.run_id, self.dist.world_size, self.config or {},
                        [step.digest for step in self.steps[:steps_taken]])

    def _resume(self) -> Position:
        """Verify the checkpoint, refuse a resume that would not be exact, then load it (every rank)."""
        found = decided_by_main(lambda: open_checkpoint(self.ckpt_path, self.out_cfg.load_checkpoint_tag))
        if found is None:
            self.notices.append(f"--load_checkpoint: no checkpoint in {self.ckpt_path}; starting from step 0")
            return Position()
        folder, saved = found
        step = tag_step(folder.name)
        changes = decided_by_main(lambda: check_resumable(folder, saved, self._state(len(self.steps)), step))
        state = load_checkpoint(self.engine, folder, self.companions)
        self.resumed_state = state
        position = Position(**{k: state[k] for k in ("epoch", "step_in_epoch", "global_step")})
        self.notices.append(f"resumed from {self.ckpt_path} at step {position.global_step} ({folder.name})")
        if changes:
            self.notices.append("resumed with changed settings (saved -> now): "
                                + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()))
        return position

    def save(self, at: Position) -> None:
        client_state = {**asdict(at), **(self.extra_state() if self.extra_state else {})}
        save_checkpoint(self.engine, self.tokenizer, self.ckpt_path, at.global_step, client_state,
                        self.out_cfg.max_ckpt_num, self.dist.is_main, self._state(at.global_step), self.companions)
        mark_memory("checkpoint save")

    def train(self, step: Callable[[PlannedStep], dict], before_save: Callable[[], None] | None = None) -> Position:
        """Run the steps, then ``before_save()`` (e.g. a reward model's normalisation), then write the final model;
        returns where training ended."""
        self.engine.train()
        self.position = run_steps(step, self.steps, self.out_cfg.logging_steps, self.out_cfg.save_steps,
                                  self.tracker, self.save, self.position)
        if before_save is not None:
            before_save()
        save_hf_model(self.engine, self.tokenizer, self.save_path / "model", self.dist.is_main,
                      adapter_dir=self.save_path / "adapter")  # LoRA: the merged model, and the adapter alone
        mark_memory("final model save")
        self.tracker.message(f"model saved to {self.save_path / 'model'}")
        return self.position


def optim_config(train_cfg, steps: int) -> OptimConfig:
    return OptimConfig(
        learning_rate=train_cfg.learning_rate,
        weight_decay=train_cfg.weight_decay,
        adam_betas=tuple(train_cfg.adam_betas),
        adam_epsilon=train_cfg.adam_epsilon,
        lr_scheduler=train_cfg.lr_scheduler,
        warmup_steps=math.ceil(train_cfg.lr_warmup_ratio * steps),
        total_steps=steps,
        min_lr_ratio=train_cfg.min_lr_ratio,
        max_norm=train_cfg.max_norm,
        max_nonfinite_steps=train_cfg.max_nonfinite_steps or DEFAULT_MAX_IN_A_ROW,
    )


def zero_config(model_cfg, dist: DistInfo) -> ZeroConfig:
    """The engine's ZeRO settings; its stage is ``engine_stage``'s (0 for ZeRO-1/2 on one CPU rank in fp32)."""
    offload = model_cfg.adam_offload or model_cfg.param_offload
    stage = engine_stage(model_cfg.zero_stage, dist.world_size, dist.device, model_cfg.bf16, offload)
    return ZeroConfig(stage, model_cfg.bf16, model_cfg.adam_offload, model_cfg.param_offload)


def start_worker(model_cfg, seed: int) -> DistInfo:
    """Join the process group, set up logging (rank 0 talks), the attention backend and the seed."""
    dist = init_distributed()
    logging.basicConfig(level=logging.INFO if dist.is_main else logging.WARNING, format="%(message)s")
    set_attention_backend(model_cfg.attn_backend)
    torch.manual_seed(seed)
    return dist


def select_data(datasets: list[str], tokenizer, tokenization, data_cfg, seed: int) -> Selection:
    """The rows of --dataset (mixed by --dataset_probs, cut to --max_samples) with each row's lengths, tokenized
    once in parallel or read from --data_cache_dir (``data/prepared.py``)."""
    return select(datasets, tokenizer, tokenization, probs=data_cfg.dataset_probs, seed=seed,
                  skip_bad_samples=data_cfg.skip_bad_samples, max_samples=data_cfg.max_samples,
                  cache_dir=data_cfg.data_cache_dir, num_proc=data_cfg.dataset_num_proc)


def finish_data(selection: Selection, data_cfg, warn_prompt_tails: Callable[[int], None]) -> Prepared:
    """The samples of ``selection`` (bad rows raised or counted), with the driver's two lines: where the lengths
    came from (tokenized, or the cache) and what the rows gave."""
    data = selection.finish(data_cfg.skip_bad_samples)
    logging.getLogger("openpack").info("data: %s", selection.notice)
    logging.getLogger("openpack").info("data: %s", data.summary)
    if data.prompt_tails:
        warn_prompt_tails(data.prompt_tails)
    return data
