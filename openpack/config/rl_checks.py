"""The checks across the sections of ``train_ppo`` and ``train_grpo`` (``rl.py``), and the one choice made from
them (``--prefix_sharing`` unset). They run before Ray, DeepSpeed or a model load, so a run that cannot work stops
in seconds with a line naming the flags; the environment files, the tools' chat template and vLLM's import are
tried here for the same reason.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from openpack.config.rl import PPORunConfig
from openpack.config.schema import ConfigError
from openpack.config.sections import check_batch_split, check_demo_pairing, check_inputs, planned_world_size
from openpack.orchestration.launch import launched_by_environment
from openpack.rl.agents.setup import agent_environment, episode_budget

GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")  # a baseline from the prompt's group


def check_rl_run(cfg: PPORunConfig) -> PPORunConfig:
    """Every check of an RL run, in order, and the config it runs: ``--prefix_sharing`` chosen where unset."""
    check_rl(cfg)
    cfg = with_prefix_sharing(cfg)
    check_inputs(cfg.data.prompt_data, {"--pretrain": cfg.model.pretrain, "--ref_pretrain": cfg.rl.ref_pretrain,
                                        "--teacher_pretrain": cfg.rl.teacher_pretrain},
                 "--prompt_data", cfg.train.prefix_sharing)
    if cfg.rl.teacher_pretrain:
        check_teacher_tokenizer(cfg.model.pretrain, cfg.rl.teacher_pretrain)
    if cfg.evaluation.eval_prompt_data:
        check_inputs([cfg.evaluation.eval_prompt_data], {}, "--eval_prompt_data")
    from openpack.models.reward import check_reward_model

    for path in cfg.rl.reward_pretrain or []:  # a causal LM here is refused now, not after the policy loads
        check_reward_model(path)
    return cfg


def with_prefix_sharing(cfg: PPORunConfig) -> PPORunConfig:
    """``--prefix_sharing`` unset: on where it is exact and possible, under --packing_samples --use_dynamic_batch
    and for a policy whose rope frequencies do not depend on a sequence's length (``models.rope``). The saved
    ``config.yaml`` holds the choice, so a resume makes the same one."""
    train = cfg.train
    if train.prefix_sharing is not None:
        return cfg
    shared = train.packing_samples and train.use_dynamic_batch
    if shared and cfg.model.pretrain is not None:
        from openpack.models.loading import load_model_config
        from openpack.models.rope import length_dependent_rope

        shared = length_dependent_rope(load_model_config(cfg.model.pretrain)) is None
    return replace(cfg, train=replace(train, prefix_sharing=shared))


def check_rl(cfg: PPORunConfig) -> None:
    """The checks that span several sections: batches, data and model, the rollout backend, rewards and KL, and
    the environment."""
    model_cfg, data_cfg, train_cfg, rollout_cfg, rl_cfg, launch_cfg = (cfg.model, cfg.data, cfg.train, cfg.rollout,
                                                                       cfg.rl, cfg.launch)
    n, completions = rollout_cfg.n_samples_per_prompt, rollout_cfg.rollout_batch_size * rollout_cfg.n_samples_per_prompt
    if rl_cfg.advantage_estimator in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(f"--advantage_estimator {rl_cfg.advantage_estimator} compares each completion with the "
                          f"others of its prompt: set --n_samples_per_prompt >= 2 (got {n})")
    if completions % train_cfg.train_batch_size:
        raise ConfigError(f"a rollout batch of {completions} completions (--rollout_batch_size x "
                          f"--n_samples_per_prompt) does not split into steps of --train_batch_size "
                          f"{train_cfg.train_batch_size}; make it a divisor")
    if train_cfg.prefix_sharing and not (train_cfg.packing_samples and train_cfg.use_dynamic_batch):
        raise ConfigError("--prefix_sharing lays each prompt's completions out in one packed row under the token cap: "
                          "add --packing_samples --use_dynamic_batch, or drop --prefix_sharing")
    check_batch_split(train_cfg, launch_cfg)
    check_shared_budget(cfg)
    longest = episode_budget(cfg)
    if train_cfg.packing_samples and train_cfg.use_dynamic_batch and train_cfg.max_tokens_per_gpu is not None \
            and longest > train_cfg.max_tokens_per_gpu:
        what = ("an episode can be {} tokens (--max_episode_tokens)" if cfg.agent.max_episode_tokens else
                "a prompt and its completion can be {} tokens (--max_len)" if longest == rollout_cfg.max_len else
                "a prompt and its completion can be {} tokens (--prompt_max_len + --generate_max_len)")
        raise ConfigError(f"{what.format(longest)}, more than --max_tokens_per_gpu {train_cfg.max_tokens_per_gpu}; "
                          "raise it or lower those")
    check_demo_pairing(model_cfg.pretrain, data_cfg.prompt_data, "--prompt_data")
    check_rollout_backend(cfg)
    if rl_cfg.dynamic_filtering and n < 2:
        raise ConfigError(f"--dynamic_filtering drops groups whose completions all score the same: set "
                          f"--n_samples_per_prompt >= 2 (got {n})")
    if rl_cfg.target_kl is not None and not (rl_cfg.init_kl_coef and not rl_cfg.use_kl_loss):
        raise ConfigError("--target_kl adapts the KL penalty in the reward: give --init_kl_coef > 0 without "
                          "--use_kl_loss, or drop --target_kl")
    if rl_cfg.use_kl_loss and not rl_cfg.init_kl_coef:
        raise ConfigError("--use_kl_loss with --init_kl_coef 0 adds nothing: set a coefficient, e.g. 0.001")
    if cfg.agent.enabled:
        check_agent(cfg)
    check_reward_files(rl_cfg)
    check_distillation(cfg)
    check_evaluation(cfg)


def check_shared_budget(cfg: PPORunConfig) -> None:
    """--max_len (a budget a completion shares with its prompt) leaves every prompt room for one token, and is for
    single completions: an episode's budget is --max_episode_tokens."""
    max_len, prompt_max_len = cfg.rollout.max_len, cfg.data.prompt_max_len
    if max_len is None:
        return
    if cfg.agent.enabled:
        raise ConfigError(f"--max_len {max_len} is the budget of a prompt and its single completion; an episode's "
                          "is --max_episode_tokens: give that instead")
    if prompt_max_len >= max_len:
        raise ConfigError(f"--prompt_max_len {prompt_max_len} leaves a prompt no room for a completion within "
                          f"--max_len {max_len}: give --prompt_max_len below it (prompts longer are left out), e.g. "
                          f"{max_len - 1}")


def check_distillation(cfg: PPORunConfig) -> None:
    """--teacher_pretrain's placement flags, and what distillation alone (a teacher, no reward) cannot drive: a
    critic, dynamic filtering or a held-out evaluation, which all read a task reward."""
    from openpack.rl.rewards import distillation_only

    model_cfg, rollout_cfg, rl_cfg = cfg.model, cfg.rollout, cfg.rl
    if rollout_cfg.teacher_num_nodes and not rl_cfg.teacher_pretrain:
        raise ConfigError("--teacher_num_nodes places the distillation teacher, and there is none: add "
                          "--teacher_pretrain PATH, or drop --teacher_num_nodes")
    if rollout_cfg.teacher_num_nodes and not (cfg.launch.launcher == "ray" and not launched_by_environment()):
        raise ConfigError("--teacher_num_nodes puts the teacher in a Ray actor of its own: use --launcher ray, or "
                          "drop it (the teacher then runs in every training rank)")
    if rl_cfg.teacher_pretrain and Path(cfg.output.save_path).resolve() in \
            [Path(rl_cfg.teacher_pretrain).resolve(), *Path(rl_cfg.teacher_pretrain).resolve().parents]:
        raise ConfigError(f"--teacher_pretrain {rl_cfg.teacher_pretrain} lies inside --save_path "
                          f"{cfg.output.save_path}, whose model this run replaces (the demo's --overwrite deletes "
                          "it first): give this run another --save_path, e.g. runs/distill_demo")
    if rl_cfg.teacher_offload and model_cfg.zero_stage != 3:
        raise ConfigError("--teacher_offload needs --zero_stage 3 (the teacher's parameters are offloaded by "
                          "ZeRO-3)")
    if not distillation_only(rl_cfg, cfg.data, cfg.agent):
        return
    alone = "with --teacher_pretrain and no reward, the teacher's per-token term is the only signal"
    if rl_cfg.advantage_estimator == "gae":
        raise ConfigError(f"--advantage_estimator gae trains a critic on the task reward's returns, and {alone} "
                          "(a critic of zero returns only adds noise): use group_norm or reinforce, or give a "
                          "reward (--reward_fn, --remote_rm_url, --reward_pretrain or --label_key)")
    if rl_cfg.dynamic_filtering:
        raise ConfigError(f"--dynamic_filtering drops groups of equal rewards, and {alone} (every reward is 0): "
                          "drop --dynamic_filtering, or give a reward")
    if cfg.evaluation.eval_prompt_data:
        raise ConfigError(f"--eval_prompt_data scores held-out samples with the run's reward, and {alone}: give "
                          "a reward (--reward_fn, --remote_rm_url, --reward_pretrain or --label_key), or drop "
                          "--eval_prompt_data")


def check_teacher_tokenizer(pretrain: str | None, teacher: str) -> None:
    """On-policy distillation scores the policy's token ids with the teacher: both tokenizers must give every id
    the same meaning (``models.loading.tokenizer_difference``). ``pretrain`` None: the demo model's tokenizer."""
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.loading import load_tokenizer, tokenizer_difference

    student = load_tokenizer(pretrain) if pretrain else build_demo_tokenizer()
    difference = tokenizer_difference(student, load_tokenizer(teacher, "--teacher_pretrain"))
    if difference:
        policy = f"--pretrain {pretrain}" if pretrain else "the demo model"
        raise ConfigError(f"--teacher_pretrain {teacher} does not share the tokenizer of {policy} ({difference}), "
                          "and distillation scores the policy's token ids with the teacher: use a teacher "
                          "trained with the policy's tokenizer, or a policy of the teacher's family")


def check_evaluation(cfg: PPORunConfig) -> None:
    """The evaluation's flags need held-out prompts, and --best_metric_key must name a metric the evaluation logs
    (its names follow from the reward flags and --eval_n_samples_per_prompt: ``rl.evaluation``)."""
    from openpack.rl.evaluation import best_metric_names

    eval_cfg = cfg.evaluation
    if not eval_cfg.eval_prompt_data:
        if eval_cfg.given():
            raise ConfigError(f"{', '.join(eval_cfg.given())} shape the held-out evaluation, and there is none: add "
                              "--eval_prompt_data, or drop them")
        return
    if eval_cfg.best_metric_key is not None:
        names = best_metric_names(eval_cfg.samples, cfg.rl, cfg.agent.enabled)
        if eval_cfg.best_metric_key not in names:
            raise ConfigError(f"--best_metric_key {eval_cfg.best_metric_key} is not a metric this run's evaluation "
                              f"logs; choose one of: {', '.join(names)}")


def check_reward_files(rl_cfg) -> None:
    """``--reward_fn path.py:function`` and ``--remote_rm_url file.py`` (OpenRLHF's reward_func file) are imported
    and their functions checked here, so a missing file, an import error, a missing function or a wrong signature
    is one line naming the flag, the file and the fix before Ray, DeepSpeed or an engine starts (it was an error
    relayed from a rank at the first rollout batch)."""
    from openpack.rl.rewards import RewardError, is_reward_file, load_openrlhf_reward, load_reward_fn

    try:
        if rl_cfg.reward_fn:
            load_reward_fn(rl_cfg.reward_fn, ("rm_scores",) if rl_cfg.reward_pretrain else ())
        if is_reward_file(rl_cfg.remote_rm_url):
            load_openrlhf_reward(rl_cfg.remote_rm_url)
    except RewardError as err:
        raise ConfigError(str(err)) from err


def check_rollout_backend(cfg: PPORunConfig) -> None:
    """What the rollout backend the run resolves to (``--rollout_backend auto``: vllm where it imports) can do with
    these flags and this many ranks, and that vLLM imports and serves the policy where it is chosen."""
    from openpack.rl.worker import resolved_backend  # here: rl.worker loads transformers, too slow for --help

    model_cfg, rollout_cfg, rl_cfg, launch_cfg = cfg.model, cfg.rollout, cfg.rl, cfg.launch
    world, backend = planned_world_size(launch_cfg), resolved_backend(rollout_cfg)
    correction = "--vllm_is_correction_cap" if rl_cfg.vllm_is_correction_cap else \
        "--is_correction_type" if rl_cfg.is_correction_type else None
    if correction and rollout_cfg.rollout_backend == "hf":
        raise ConfigError(f"{correction} corrects vLLM's sampling mismatch; with --rollout_backend hf the policy "
                          "samples itself: drop it")
    if rollout_cfg.partial_rollout and backend == "hf":
        raise ConfigError(f"--partial_rollout lands weights inside vLLM's generation; with --rollout_backend "
                          f"{rollout_cfg.rollout_backend} (HF) the policy generates itself, never during an update: "
                          "drop --partial_rollout, or use --rollout_backend vllm")
    if rollout_cfg.async_train and backend == "hf":
        raise ConfigError(f"--async_train overlaps vLLM's generation with training; with --rollout_backend "
                          f"{rollout_cfg.rollout_backend} (HF) the policy generates itself and nothing overlaps: "
                          "drop --async_train, or use --rollout_backend vllm")
    if world > 1 and backend == "hf" and model_cfg.zero_stage == 3:  # different lengths, split params
        raise ConfigError(f"HF rollouts under --zero_stage 3 on {world} ranks are not supported (each rank's "
                          "generate would need the others' partitions at every token): use --rollout_backend "
                          "vllm, or --zero_stage 2")
    if world > 1 and backend == "vllm" and (launch_cfg.launcher != "ray" or launched_by_environment()):
        raise ConfigError(f"vLLM engines with {world} ranks run as Ray actors: use --launcher ray (not torchrun "
                          "or the deepspeed launcher; an engine inside a rank of a process group hangs), or "
                          "--rollout_backend hf")
    if rollout_cfg.colocate_all_models:
        check_colocation(rollout_cfg, world, backend)
    if backend == "vllm":
        check_servable(model_cfg.pretrain, rollout_cfg)


def check_agent(cfg: PPORunConfig) -> None:
    """What multi-turn episodes cannot be combined with; the environment files load here, before any model."""
    agent_cfg, rl_cfg, data_cfg = cfg.agent, cfg.rl, cfg.data
    flag = "--tools" if agent_cfg.tools else "--agent_func_path" if agent_cfg.agent_func_path else "--env_file"
    if not agent_cfg.tools and (rl_cfg.reward_fn or rl_cfg.remote_rm_url or rl_cfg.reward_pretrain):
        raise ConfigError(f"{flag}: the environment gives each episode its reward; drop --reward_fn, "
                          "--remote_rm_url and --reward_pretrain (with --tools, --reward_fn scores the final answer)")
    if agent_cfg.tools and (rl_cfg.remote_rm_url or rl_cfg.reward_pretrain):
        raise ConfigError("--tools scores the final answer with --reward_fn or exact match with --label_key; drop "
                          "--remote_rm_url and --reward_pretrain")
    if agent_cfg.tools and not (rl_cfg.reward_fn or data_cfg.label_key):
        raise ConfigError("--tools scores each episode's final answer: give --label_key (exact match with that "
                          "column) or --reward_fn path.py:function")
    if agent_cfg.per_turn_reward and rl_cfg.advantage_estimator not in ("reinforce", "gae"):
        raise ConfigError(f"--per_turn_reward discounts each turn's reward from its own token, which "
                          f"--advantage_estimator {rl_cfg.advantage_estimator} (one scalar per episode) cannot use: "
                          "use reinforce or gae, or drop --per_turn_reward")
    if agent_cfg.per_turn_reward and rl_cfg.overlong_buffer_len:
        raise ConfigError("--per_turn_reward credits the turns' own rewards: drop --overlong_buffer_len, which "
                          "shapes an episode's one reward")
    if rl_cfg.overlong_buffer_len:
        raise ConfigError(f"{flag}: --overlong_buffer_len penalises long single completions; bound episodes with "
                          "--max_episode_tokens and --max_turns instead")
    from openpack.rl.agents.environment import EnvFileError
    from openpack.rl.rewards import RewardError

    try:
        _, tools = agent_environment(agent_cfg, rl_cfg.reward_fn, data_cfg.label_key)
    except (EnvFileError, RewardError) as err:  # RewardError: --tools' --reward_fn scorer
        raise ConfigError(str(err)) from err
    if tools and cfg.model.pretrain:
        check_shows_tools(cfg.model.pretrain, tools)


def check_shows_tools(pretrain: str, tools: list[dict]) -> None:
    """--tools needs a chat template that shows the tools: one that renders ``tools=`` (Qwen's, Hermes-style)."""
    from openpack.models.loading import load_tokenizer

    tokenizer = load_tokenizer(pretrain)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--tools: the tokenizer of --pretrain {pretrain} has no chat template to show tools "
                          "with; use a model whose template renders tools= (Qwen-family), or --env_file")
    messages = [{"role": "user", "content": "1"}]
    shown = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if shown == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True):
        raise ConfigError(f"--tools: the chat template of --pretrain {pretrain} ignores tools=, so the model would "
                          "never see them; use a model whose template renders tools (Qwen-family), or --env_file")


def check_servable(pretrain: str | None, rollout_cfg) -> None:
    """vLLM rollouts are refused before Ray or an engine starts where vLLM does not import (with the commands that
    install it), or cannot serve ``pretrain`` here (the demo model, None, it serves)."""
    from openpack.rollout.vllm_support import import_vllm, unservable_reason

    try:
        import_vllm()
    except RuntimeError as err:  # not installed, broken (torchvision::nms) or another minor version (also for auto)
        raise ConfigError(f"--rollout_backend {rollout_cfg.rollout_backend}: {err}") from err
    reason = unservable_reason(pretrain) if pretrain else None
    if reason:
        raise ConfigError(f"--rollout_backend vllm cannot serve --pretrain {pretrain}: {reason}. Use "
                          "--rollout_backend hf (the policy generates itself), or a model of a supported shape")


def check_colocation(rollout_cfg, world: int, backend: str) -> None:
    """What --colocate_all_models cannot do (``backend``: the resolved --rollout_backend): overlap anything, run
    without engines, or split an engine."""
    if getattr(rollout_cfg, "async_train", False):
        raise ConfigError("--colocate_all_models with --async_train: on shared devices generation and training "
                          "cannot overlap; drop one")
    if backend != "vllm":
        raise ConfigError("--colocate_all_models colocates vLLM engines; with --rollout_backend hf the policy "
                          "already generates on its own devices: drop it, or use --rollout_backend vllm")
    for flag in ("ref_num_nodes", "teacher_num_nodes"):
        if getattr(rollout_cfg, flag, 0):
            model = "reference model" if flag == "ref_num_nodes" else "distillation teacher"
            raise ConfigError(f"--colocate_all_models keeps the {model} in the training ranks: drop --{flag}")
    if rollout_cfg.vllm_num_engines > world or rollout_cfg.vllm_tensor_parallel_size > 1:
        raise ConfigError(f"--colocate_all_models puts engine i on rank i's device: --vllm_num_engines "
                          f"{rollout_cfg.vllm_num_engines} must be at most the {world} rank(s), with "
                          "--vllm_tensor_parallel_size 1 (tensor-parallel colocated engines are not built)")
