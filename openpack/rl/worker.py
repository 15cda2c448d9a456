"""What ``openpack train_ppo`` / ``train_grpo`` runs on each rank: set-up, then one RL step per rollout batch.

rank: process group -> tokenizer, policy, prompts -> the rollout schedule
(seeded prompt order per episode, cut into rollout batches) -> the shared
run (engine, resume, tracker, checkpoints; ``trainers/run.py``) ->
reference model (when a KL term needs one) and distillation teacher
(--teacher_pretrain) -> rollout engines (vLLM actors
handed over by the driver, in-process vLLM, or HF generation with the
policy itself) -> (demo: held-out exact match; --eval_prompt_data: the held-out evaluation before training, every
--eval_steps and at the end, ``evaluation.py``) -> steps -> final model.

A planned step of ``TrainingRun`` is one rollout batch here: checkpoints,
``--save_steps``, ``--max_steps``, the progress bar and metrics.jsonl count
rollout steps, while the learning-rate schedule counts optimizer steps. A
step's digest names its prompts, so a resume with other data or seeds is
refused, and each request's sampling seed comes from the run's seed and
the prompt's place in the schedule, so a resumed run samples what the
uninterrupted one did.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import replace

from openpack.core.advantages import kl_controller
from openpack.core.packing import shuffled_epoch
from openpack.data.loading import DataError
from openpack.data.prepared import select
from openpack.data.prompt_set import PromptSet, PromptTokenization
from openpack.data.prompts import Prompt
from openpack.distributed.checkpoint import save_hf_model
from openpack.models.loading import load_causal_lm, load_tokenizer
from openpack.models.lora import apply_lora, is_lora
from openpack.rl.colocation import Colocation
from openpack.rl.generation import Generator, make_generator
from openpack.rl.pipeline import RolloutPipeline
from openpack.rl.experience import Scorers
from openpack.rl.rewards import DistillationOnly, EpisodeRewards, SourceRewards, distillation_only, reward_source
from openpack.rl.settings import rl_settings
from openpack.rl.evaluation import BestPolicy, Evaluation, with_evaluation
from openpack.rl.step import EmptySteps, RLLoop, RolloutBatch, rl_step, send_weights
from openpack.trainers import demo, reference
from openpack.trainers.batching import join_context
from openpack.trainers.run import TrainingRun, start_worker
from openpack.trainers.tracking import MetricLimit

logger = logging.getLogger("openpack")


LOGP_DIFF_LIMIT = {"fp32": 1e-3, "bf16": 0.1}  # vllm_logp_diff above this warns once (logp_diff_limit)


def rollout_schedule(num_prompts: int, rollout_batch_size: int, num_episodes: int, seed: int,
                     max_steps: int | None) -> list[list[int]]:
    """Prompt ids of every rollout batch: each episode a seeded permutation cut into full batches."""
    per_episode = num_prompts // rollout_batch_size
    if per_episode == 0:
        raise DataError(f"{num_prompts} prompts make no rollout batch of --rollout_batch_size {rollout_batch_size}; "
                        "lower --rollout_batch_size or add prompts")
    batches = []
    for episode in range(num_episodes):
        order = shuffled_epoch(num_prompts, seed, episode)
        batches += [order[i * rollout_batch_size:(i + 1) * rollout_batch_size] for i in range(per_episode)]
    return batches[:max_steps] if max_steps else batches


def load_prompts(data_cfg, tokenizer, seed: int, datasets: list[str], flag: str = "--prompt_data") -> PromptSet:
    """The prompts of --prompt_data (mixed by --prompt_data_probs, cut to --max_samples): checked and tokenized once
    in parallel, or read from --data_cache_dir, and kept as row ids (``data/prompt_set.py``)."""
    how = PromptTokenization(data_cfg.input_key, data_cfg.apply_chat_template, data_cfg.input_template,
                             data_cfg.prompt_max_len, data_cfg.label_key)
    selection = select(datasets, tokenizer, how, probs=data_cfg.prompt_data_probs, seed=seed,
                       skip_bad_samples=data_cfg.skip_bad_samples, max_samples=data_cfg.max_samples, flag=flag,
                       cache_dir=data_cfg.data_cache_dir, num_proc=data_cfg.dataset_num_proc)
    data = selection.finish(data_cfg.skip_bad_samples)
    logger.info("prompts: %s", selection.notice)
    (logger.warning if "left out" in data.summary else logger.info)("prompts: %s", data.summary)
    return PromptSet(selection.files, data.rows, tokenizer, how)


def vllm_available() -> bool:
    from openpack.distributed.run_log import route_noise

    route_noise()  # vLLM's import logs a Triton notice on CPU
    try:
        import vllm  # noqa: F401
    except Exception:  # not installed, or installed but broken (torchvision::nms): the HF path still works
        return False
    return True


def resolved_backend(rollout_cfg) -> str:
    """--rollout_backend, with auto -> vllm when it imports, else hf."""
    if rollout_cfg.rollout_backend != "auto":
        return rollout_cfg.rollout_backend
    return "vllm" if vllm_available() else "hf"


def plan_rl(cfg, world_size: int, demo_model=None) -> list:
    """The driver's check before any actor starts: the prompts load and make a rollout batch. Ranks plan alone
    (every rank holds every prompt: they are small). ``cfg``: the run's ``PPORunConfig``."""
    model_cfg, data_cfg, train_cfg, rollout_cfg = cfg.model, cfg.data, cfg.train, cfg.rollout
    tokenizer = load_tokenizer(model_cfg.pretrain or str(demo_model))
    prompts = load_prompts(data_cfg, tokenizer, train_cfg.seed, prompt_datasets(data_cfg, cfg.output, True))
    rollout_schedule(len(prompts), rollout_cfg.rollout_batch_size, rollout_cfg.num_episodes, train_cfg.seed,
                     train_cfg.max_steps)
    return [None] * world_size


def prompt_datasets(data_cfg, out_cfg, is_main: bool) -> list[str]:
    from pathlib import Path

    return data_cfg.prompt_data or demo.write_prompt_data(Path(out_cfg.save_path), is_main)


def run_ppo(cfg, demo_model=None, save_config=None, engine_group=None, plan=None, reward_groups=None,
            reference_group=None, teacher_group=None) -> int:
    """One rank's RL run of ``cfg`` (its ``PPORunConfig``); ``engine_group``: the driver's vLLM engine actors (Ray), else engines are made here;
    ``reward_groups``: the driver's reward-model actor groups (Ray), else rank 0 loads the reward models;
    ``reference_group`` / ``teacher_group``: the driver's reference / distillation teacher actor (Ray), else each
    rank holds that model."""
    model_cfg, data_cfg, train_cfg, out_cfg, rollout_cfg, rl_cfg = (cfg.model, cfg.data, cfg.train, cfg.output,
                                                                    cfg.rollout, cfg.rl)
    dist = start_worker(model_cfg, train_cfg.seed)
    pretrain = model_cfg.pretrain or str(demo_model)
    tokenizer = load_tokenizer(pretrain)
    model = load_causal_lm(pretrain, model_cfg.bf16, model_cfg.gradient_checkpointing,
                           load_in_4bit=model_cfg.load_in_4bit,
                           aux_loss_coef=model_cfg.aux_loss_coef).to(dist.device)
    model = apply_lora(model, model_cfg)
    context = join_context(cfg.train, model)  # --ring_attn_size: this rank's part of each training-side row
    cfg = with_row_cap(cfg, model, dist)
    train_cfg = cfg.train
    datasets = prompt_datasets(data_cfg, out_cfg, dist.is_main)
    from openpack.distributed.process import barrier

    barrier()  # rank 0 wrote the demo prompts
    prompts = load_prompts(data_cfg, tokenizer, train_cfg.seed, datasets)
    schedule = rollout_schedule(len(prompts), rollout_cfg.rollout_batch_size, rollout_cfg.num_episodes,
                                train_cfg.seed, train_cfg.max_steps)
    settings = rl_settings(cfg)
    batches = [_planned(i, ids, train_cfg.seed, rollout_cfg) for i, ids in enumerate(schedule)]
    optimizer_steps = len(schedule) * settings.updates_per_rollout
    critic = critic_engine(cfg, pretrain, tokenizer, dist, optimizer_steps) \
        if settings.critic else None
    kl_ctl = kl_controller(rl_cfg.init_kl_coef, rl_cfg.target_kl, rl_cfg.kl_horizon)
    empty = EmptySteps()
    run = TrainingRun(model, tokenizer, batches, cfg, dist, save_config,
                      optimizer_steps=optimizer_steps, companions={"critic": critic} if critic else None,
                      extra_state=lambda: {"kl_controller": kl_ctl.state_dict(), "empty_steps": empty.in_a_row})
    run.engine.step_guard.name = "policy"  # its optimizer steps are not the rollout steps: named in its lines
    if not settings.async_staleness:  # asynchronous, the difference also measures staleness (docs/rl.md)
        run.tracker.watch(logp_diff_limit(model_cfg.bf16))
    if "kl_controller" in run.resumed_state:
        kl_ctl.load_state_dict(run.resumed_state["kl_controller"])
    empty.in_a_row = run.resumed_state.get("empty_steps", 0)  # a resumed run stops where the uninterrupted one would
    scorers = Scorers(old=run.engine if settings.needs_old_pass else None, values=critic,
                      ref=rl_reference(cfg, settings, run, model, pretrain, dist, reference_group),
                      teacher=rl_teacher(cfg, settings, dist, teacher_group))
    backend = resolved_backend(rollout_cfg)
    if dist.is_main:
        logger.info("rollouts: %s%s", backend, " (auto: vLLM imports)" if rollout_cfg.rollout_backend == "auto"
                    and backend == "vllm" else " (auto: vLLM is not installed)" if rollout_cfg.rollout_backend
                    == "auto" else "")
    generator = make_generator(backend, rollout_cfg, pretrain, run.engine.module.model, tokenizer, train_cfg.seed,
                               dist, engine_group, model_cfg.bf16, run.save_path)
    sync = _weight_sync(backend, rollout_cfg, generator, run.engine.module, dist)
    if cfg.agent.enabled:  # multi-turn episodes: their environments give the rewards
        generator, rewards = agent_generator(cfg, generator, tokenizer), EpisodeRewards()
    elif distillation_only(rl_cfg, data_cfg, cfg.agent):  # the teacher's signal alone
        rewards = DistillationOnly()
    else:
        rewards = SourceRewards(reward_source(rl_cfg, data_cfg, demo_model is not None,
                                              reward_scorers(cfg, dist, reward_groups)),
                                tokenizer, settings.n_samples_per_prompt)
    pipeline = RolloutPipeline(generator, prompts, schedule, settings.async_staleness, rollout_cfg.async_train,
                               rollout_cfg.partial_rollout)
    colocation = Colocation(generator.engines, [run.engine, critic], functools.partial(
        send_weights, sync, run.engine, dist), dist.is_main) if rollout_cfg.colocate_all_models else None
    if sync is not None and colocation is None and run.position.global_step:  # resumed: the engines still hold
        with pipeline.landing(run.position.global_step, dist):  # the starting weights (colocated: pushed at
            send_weights(sync, run.engine, dist)  # each wake)
    loop = RLLoop(run=run, pipeline=pipeline, rewards=rewards, scorers=scorers, settings=settings, prompts=prompts,
                  dist=dist, pad_token_id=tokenizer.pad_token_id or 0, sync=sync, critic=critic, kl_ctl=kl_ctl,
                  colocation=colocation, empty_steps=empty, context=context)
    step = functools.partial(rl_step, loop)
    evaluation = held_out_evaluation(cfg, generator, rewards, tokenizer, run) \
        if cfg.evaluation.eval_prompt_data else None
    if evaluation is not None:
        step = with_evaluation(step, evaluation, loop, len(schedule))
    with run.tracker:
        if demo_model is not None:
            _report_demo(run, "before")
        if evaluation is not None:
            evaluation(loop, "before training", run.position.global_step, candidate=False)
        run.train(step, before_save=None if critic is None else functools.partial(
            save_hf_model, critic, tokenizer, run.save_path / "critic", dist.is_main))
        if demo_model is not None:
            _report_demo(run, "after")
        if evaluation is not None:
            evaluation(loop, "after training", run.position.global_step)
    return 0


def held_out_evaluation(cfg, generator, rewards, tokenizer, run: TrainingRun) -> Evaluation:
    """--eval_prompt_data's evaluation (``rl/evaluation.py``): the held-out prompts (every one: neither
    --prompt_data_probs nor --max_samples applies), the run's engines sampling n of each at the evaluation's
    temperature, the run's reward sources (episodes: their environments), and --best_metric_key's best so far."""
    eval_cfg, rollout_cfg = cfg.evaluation, cfg.rollout
    data_cfg = replace(cfg.data, prompt_data_probs=None, max_samples=None)
    prompts = load_prompts(data_cfg, tokenizer, cfg.train.seed, [eval_cfg.eval_prompt_data], "--eval_prompt_data")
    n, temperature = eval_cfg.samples, eval_cfg.temperature(rollout_cfg.temperature)
    sampling = replace(rollout_sampling(generator), n=n, temperature=temperature)
    best = BestPolicy.of_run(eval_cfg.best_metric_key, run.save_path, run.run_id) \
        if eval_cfg.best_metric_key else None
    return Evaluation(prompts, generator.with_sampling(sampling),
                      None if cfg.agent.enabled else SourceRewards(rewards.source, tokenizer, n), n, temperature,
                      eval_cfg.eval_pass_threshold or 0.0, eval_cfg.eval_steps, best)


def rollout_sampling(generator):
    """The sampling of the run's rollouts (an AgentGenerator's is its single-turn generator's)."""
    return getattr(generator, "generator", generator).sampling


def agent_generator(cfg, generator: Generator, tokenizer):
    """Episodes of the run's environment instead of single completions (``rl/agents``): each prompt row, with its
    --input_key as ``prompt`` (for OpenRLHF's agent files the prompt as the model sees it: templates applied, as
    OpenRLHF renders it before ``reset``) and its --label_key as ``label``, is the sample an environment resets
    on."""
    from openpack.rl.agents.generation import AgentGenerator
    from openpack.rl.agents.setup import agent_environment, concurrency, episode_limits, max_failure_fraction

    agent_cfg, data_cfg = cfg.agent, cfg.data
    make_env, tools = agent_environment(agent_cfg, cfg.rl.reward_fn, data_cfg.label_key)
    rendered = getattr(make_env, "resets_on_rendered_prompt", False)  # OpenRLHF's files: the text the model sees

    def sample_of(prompt: Prompt) -> dict:
        row = dict(prompt.row)
        label = row.get(data_cfg.label_key) if data_cfg.label_key else row.get("label")
        return {**row, "prompt": prompt.text if rendered else row[data_cfg.input_key], "label": label}

    return AgentGenerator(generator, make_env, sample_of, tokenizer, episode_limits(cfg), concurrency(agent_cfg),
                          max_failure_fraction(agent_cfg), tools)


def with_row_cap(cfg, model, dist):
    """``cfg`` with ``--max_tokens_per_gpu`` set where it was left unset: rank 0's ``default_row_cap`` for the
    policy (every rank plans with it; under --ring_attn_size N for a rank's 1/N of a row), logged once. Also without dynamic batches: the scoring passes (reference,
    old policy, critic values, reward models) pack their rows under it."""
    train_cfg = cfg.train
    if train_cfg.max_tokens_per_gpu is not None:
        return cfg
    from openpack.distributed.process import broadcast_object
    from openpack.rl.agents.setup import episode_budget
    from openpack.trainers.batching import context_parallel_size, default_row_cap

    ring = context_parallel_size(train_cfg)
    longest = -(-episode_budget(cfg) // ring)  # a rank's share of the longest sample: N ranks share a row
    cap, why = broadcast_object(default_row_cap(model, cfg.model, dist, longest) if dist.is_main else None)
    if dist.is_main:
        logger.info("--max_tokens_per_gpu not given: packed rows of at most %d tokens (%s; pass "
                    "--max_tokens_per_gpu to choose)", cap, why)
    return replace(cfg, train=replace(train_cfg, max_tokens_per_gpu=cap))


def logp_diff_limit(bf16: bool) -> MetricLimit:
    """When ``vllm_logp_diff`` says the sampler is not sampling the trained policy: above 1e-3 in fp32 (runs stay
    at 1e-7 to 1e-5; a tied head that never reached vLLM gave 0.013 to 0.024), above 0.1 in bf16 (its rounding
    alone gives up to about 0.08). docs/rl.md, "Weight sync and the vLLM mismatch"."""
    return MetricLimit("vllm_logp_diff", LOGP_DIFF_LIMIT["bf16" if bf16 else "fp32"],
                       "the sampler's log-probs of its own tokens differ from the trainer's, so it samples from "
                       "other weights than those trained (with vLLM: a weight the sync does not reach, or another "
                       "dtype); see docs/rl.md, 'Weight sync and the vLLM mismatch'")


def rl_reference(cfg, settings, run: TrainingRun, model, pretrain: str, dist, reference_group):
    """What scores the reference log-probs where a KL term needs them: the driver's reference actor (Ray), the
    LoRA policy with its adapters off, or a reference model on this rank; None without a KL term."""
    if not settings.needs_reference:
        return None
    if reference_group is not None:
        return reference_group.scorer(dist.rank)
    if is_lora(model) and not cfg.rl.ref_pretrain:
        return reference.AdapterReference(run.engine, model, dist.device)  # LoRA: the base, adapters off
    return build_rl_reference(cfg, pretrain, dist)


def build_rl_reference(cfg, pretrain: str, dist=None):
    """The frozen reference model scoring per-token log-probs (``ref(batch)``): a rank's own DeepSpeed engine, or
    (``dist`` None) the model of a Ray reference actor, which starts its own process group first."""
    flag = "--ref_pretrain" if cfg.rl.ref_pretrain else "--pretrain"
    return frozen_scorer(cfg.model, cfg.rl.ref_pretrain or pretrain, flag, False, dist)


def rl_teacher(cfg, settings, dist, teacher_group):
    """What scores the teacher's log-probs of on-policy distillation (--teacher_pretrain): the driver's teacher
    actor (Ray, --teacher_num_nodes 1), else a teacher model on this rank, built as the reference is (ZeRO-3
    partitions it like the policy; --teacher_offload keeps its parameters on the CPU); None without one."""
    if not settings.distills:
        return None
    if teacher_group is not None:
        return teacher_group.scorer(dist.rank)
    return build_rl_teacher(cfg, dist)


def build_rl_teacher(cfg, dist=None):
    """The frozen distillation teacher: a rank's own DeepSpeed engine, or (``dist`` None) a Ray teacher actor's."""
    return frozen_scorer(cfg.model, cfg.rl.teacher_pretrain, "--teacher_pretrain", cfg.rl.teacher_offload, dist)


def frozen_scorer(model_cfg, path: str, flag: str, offload: bool, dist=None):
    """A frozen model at ``path`` (errors name ``flag``) scoring per-token log-probs: a rank's own DeepSpeed engine
    (ZeRO-3 under --zero_stage 3, its parameters on the CPU with ``offload``), or (``dist`` None) a Ray actor's
    ``ModelReference``, which starts its own process group first."""
    in_actor = dist is None
    dist = start_worker(model_cfg, 0) if in_actor else dist
    model = load_causal_lm(path, model_cfg.bf16, flag=flag).to(dist.device)
    engine = reference.reference_engine(model, model_cfg.zero_stage, offload, model_cfg.bf16)
    return reference.ModelReference(engine, dist.device) if in_actor else engine


def critic_start(rl_cfg, pretrain: str) -> tuple[str, str]:
    """Where the critic starts, and the flag that names it: --critic_pretrain, else the first --reward_pretrain, else
    the policy's own weights (``pretrain``) with a new value head, as OpenRLHF's train_ppo_ray picks it."""
    if rl_cfg.critic_pretrain:
        return rl_cfg.critic_pretrain, "--critic_pretrain"
    if rl_cfg.reward_pretrain:
        return rl_cfg.reward_pretrain[0], "--reward_pretrain"
    return pretrain, "--pretrain"


def critic_engine(cfg, pretrain: str, tokenizer, dist, optimizer_steps: int):
    """The critic's DeepSpeed engine: ``critic_start``'s model as a value model, trained at --critic_learning_rate on
    the policy's schedule."""
    from openpack.distributed.engine import create_engine
    from openpack.models.reward import HEAD, PackedValueModel, load_reward_model
    from openpack.trainers.run import optim_config, zero_config

    model_cfg, train_cfg, rl_cfg = cfg.model, cfg.train, cfg.rl
    path, flag = critic_start(rl_cfg, pretrain)
    model = load_reward_model(path, model_cfg.bf16, model_cfg.gradient_checkpointing,
                              pad_token_id=tokenizer.pad_token_id, flag=flag,
                              load_in_4bit=model_cfg.load_in_4bit).to(dist.device)
    model = apply_lora(model, model_cfg, head=HEAD)
    optim = optim_config(replace(train_cfg, learning_rate=rl_cfg.critic_learning_rate), optimizer_steps)
    engine = create_engine(PackedValueModel(model), optim, zero_config(model_cfg, dist), dist.world_size)
    engine.step_guard.name = "critic"
    return engine


def reward_scorers(cfg, dist, reward_groups) -> list | None:
    """What scores --reward_pretrain: the driver's actor groups, else (rank 0 only; it alone asks for rewards) the
    reward models loaded here."""
    model_cfg, train_cfg, rl_cfg = cfg.model, cfg.train, cfg.rl
    if not rl_cfg.reward_pretrain:
        return None
    if reward_groups is not None:
        return reward_groups
    if not dist.is_main:
        return []
    from openpack.models.reward import RewardScorer

    return [RewardScorer(path, dist.device, train_cfg.max_tokens_per_gpu, model_cfg.bf16)
            for path in rl_cfg.reward_pretrain]


def _planned(index: int, prompt_ids: list[int], seed: int, rollout_cfg) -> RolloutBatch:
    """A rollout batch as a planned step of ``TrainingRun``, its digest naming the seed, n and its prompts."""
    key = f"{seed}/{rollout_cfg.n_samples_per_prompt}/{prompt_ids}"
    return RolloutBatch(index, list(prompt_ids), hashlib.sha256(key.encode()).hexdigest()[:16])


def _weight_sync(backend: str, rollout_cfg, generator: Generator, policy, dist):
    """The engines' weight sync, after rank 0 checked that what it sends is every weight the engines hold."""
    if backend != "vllm":
        return None  # HF generation samples from the policy itself
    from openpack.rollout.weight_sync import check_weight_names, make_weight_sync, policy_weight_names

    if dist.is_main:
        check_weight_names(generator.engines, policy_weight_names(policy))
    return make_weight_sync(rollout_cfg.vllm_sync_backend, generator.engines)


def _report_demo(run: TrainingRun, when: str) -> None:
    """Held-out exact match of the demo (greedy, every held-out problem): the share of bare right answers."""
    model = run.engine.module.model
    rates = demo.accuracy(model, run.tokenizer)
    run.tracker.message(f"held-out {when} training: exact match {rates['eval_bare_answer']:.1%} "
                        f"({demo.describe(rates)})")
    run.tracker.log(run.position.global_step, {"eval_exact_match": rates["eval_bare_answer"],
                                               "eval_right_answer": rates["eval_exact_match"]})
