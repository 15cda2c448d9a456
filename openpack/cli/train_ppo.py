"""``openpack train_ppo`` and ``openpack train_grpo``: online RL on packed experience, rollouts from vLLM or HF.

One command with two defaults: ``train_grpo`` is ``train_ppo --advantage_estimator
group_norm --n_samples_per_prompt 8``. With no ``--pretrain`` and no
``--prompt_data`` each runs a built-in demo from the SFT demo model (trained
first and cached), which answers the addition task right but wordily:
``train_grpo`` learns the bare form from the exact-match reward alone;
``train_ppo`` learns it from the reward-model demo's model (trained first and
cached), with a critic and GAE. Held-out exact match is reported before and
after.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from openpack.config.schema import ConfigError, RunConfig, arg
from openpack.rl.agents import setup as agent_setup
from openpack.rl.agents.setup import agent_environment, episode_budget
from openpack.cli.train_sft import (LaunchConfig, ModelConfig, OutputConfig, TrainConfig, announce, check_inputs,
                                    check_template_flags, demo_sft_model, planned_world_size, with_demo_defaults)
from openpack.core.advantages import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from openpack.core.rl_losses import LOSS_AGG_MODES
from openpack.orchestration.launch import launch, launched_by_environment

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "grpo.yaml"
PPO_DEMO_CONFIG = DEMO_CONFIG.with_name("ppo.yaml")
AGENT_DEMO_CONFIG = DEMO_CONFIG.with_name("agent.yaml")
GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")  # a baseline from the prompt's group


@dataclass
class PromptDataConfig:
    prompt_data: list[str] | None = arg(None, "prompt datasets: HF names or local .json/.jsonl/.parquet files or "
                                        "folders; none: the built-in demo's prompts")
    prompt_data_probs: list[float] | None = arg(None, "sampling probability of each --prompt_data (sums to 1)",
                                                above=0, special={None: "datasets concatenated"})
    input_key: str = arg("prompt", "key of the prompt in each row: a text, or a list of chat messages")
    label_key: str | None = arg(None, "key of a reference answer: passed to rewards (rows, and 'labels' of "
                                "--remote_rm_url); alone, the reward is exact match of the completion to it")
    apply_chat_template: bool = arg(False, "text prompts become a user turn of the tokenizer's chat template, ending "
                                    "with its generation prompt (lists of messages always do)")
    input_template: str | None = arg(None, "text prompts become this with {} replaced by the prompt, e.g. "
                                     "$'User: {}\\nAssistant: ' (OpenRLHF's flag)")
    prompt_max_len: int = arg(1024, "prompts longer than this many tokens are left out (and counted)", at_least=1)
    max_samples: int | None = arg(None, "use at most this many prompts", at_least=1, special={None: "every prompt"})
    skip_bad_samples: bool = arg(False, "skip and count malformed rows instead of stopping with an error")

    def validate(self):
        check_template_flags(self.input_template, self.apply_chat_template)


@dataclass
class RLTrainConfig(TrainConfig):
    """TrainConfig with the meanings OpenRLHF's PPO gives some of its flags."""

    train_batch_size: int = arg(128, "completions per optimizer step, over all ranks (a rollout batch of "
                                "--rollout_batch_size x --n_samples_per_prompt is cut into these)", at_least=1)
    max_epochs: int = arg(1, "passes over each rollout batch (PPO epochs)", at_least=1)
    max_steps: int | None = arg(None, "stop after this many rollout batches", at_least=1,
                                special={None: "every rollout batch of --num_episodes"})
    learning_rate: float = arg(1e-6, "peak learning rate of the policy (AdamW; OpenRLHF's --actor_learning_rate)",
                               above=0)
    lr_warmup_ratio: float = arg(0.0, "share of optimizer steps spent warming up linearly", at_least=0, at_most=1)
    lr_scheduler: str = arg("constant", "schedule after warmup", choices=["cosine", "linear", "constant"])
    max_tokens_per_gpu: int | None = arg(None, "token cap of a packed row under --use_dynamic_batch", at_least=2,
                                         special={None: "from the model's size and the device's memory, logged at "
                                                        "start (docs/rl.md, Row cap)"})
    prefix_sharing: bool | None = arg(None, "lay each prompt's completions out as one group prompt | completion | "
                                      "... in every training-side pass (policy, old policy, reference, critic), the "
                                      "prompt computed once; the steps train the same completions as without it "
                                      "(docs/rl.md, Prefix sharing)",
                                      special={None: "on under --packing_samples --use_dynamic_batch, unless the "
                                                     "policy's rope frequencies depend on length; off otherwise"})


@dataclass
class RolloutConfig:
    rollout_backend: str = arg("auto", "who generates: vllm (engine actors, weights synced after every update), hf "
                               "(transformers' generate in the training ranks), auto (vllm if it imports, else hf)",
                               choices=["auto", "vllm", "hf"])
    vllm_num_engines: int = arg(1, "vLLM engines (Ray actors under --launcher ray; in rank 0's process otherwise)",
                                at_least=1)
    vllm_tensor_parallel_size: int = arg(1, "GPUs per vLLM engine", at_least=1)
    vllm_gpu_memory_utilization: float = arg(0.9, "share of a GPU's memory vLLM may take (weights + KV cache)",
                                             above=0, at_most=1)
    vllm_sync_backend: str = arg("inhost", "how weights reach the engines: inhost (tensors through Ray or the "
                                 "process: works everywhere, the CPU path) or nccl (broadcast from rank 0 into the "
                                 "engines' GPUs: multi-node GPUs; not run on hardware yet)", choices=["inhost", "nccl"])
    rollout_batch_size: int = arg(128, "prompts per rollout batch", at_least=1)
    n_samples_per_prompt: int = arg(1, "completions sampled per prompt", at_least=1)
    micro_rollout_batch_size: int = arg(32, "prompts per generate call with --rollout_backend hf", at_least=1)
    generate_max_len: int = arg(1024, "most tokens a completion may have", at_least=1)
    temperature: float = arg(1.0, "sampling temperature (log-probs are scored at temperature 1 either way)", above=0)
    top_p: float = arg(1.0, "nucleus sampling: the smallest set of tokens with this much probability", above=0,
                       at_most=1)
    num_episodes: int = arg(1, "passes over the prompts", at_least=1)
    async_train: bool = arg(False, "generate the next rollout batches with the current weights while training on "
                            "this one (vLLM engines; docs/rl.md, Asynchronous training)")
    max_staleness: int | None = arg(None, "with --async_train: rollout batches generated ahead of training, so the "
                                    "most policy versions between sampling a rollout and training on it (0: the "
                                    "synchronous loop)", at_least=0, special={None: "1 with --async_train"})
    colocate_all_models: bool = arg(False, "policy, reference, reward models and vLLM share the training ranks' "
                                    "devices, taking turns: vLLM sleeps while DeepSpeed trains, DeepSpeed's states "
                                    "are offloaded while vLLM generates (docs/rl.md, Placement)")
    colocate_critic_reward: bool = arg(False, "the reward models run inside the training ranks, on rank 0, next to "
                                       "the critic, instead of their own actor group (--launcher ray)")
    ref_num_nodes: int = arg(0, "the reference model (a KL needs one) in a Ray actor of its own, one process on "
                             "one node, which every rank asks for its share (train_dpo's flag)", at_least=0, at_most=1,
                             special={0: "in every training rank"})

    def validate(self):
        if self.max_staleness is not None and not self.async_train:  # it would be ignored: the loop is synchronous
            raise ConfigError(f"--max_staleness {self.max_staleness} bounds how far generation runs ahead of "
                              "training under --async_train, and this run is synchronous: add --async_train, or "
                              "drop --max_staleness")


@dataclass
class RLConfig:
    advantage_estimator: str = arg("reinforce", "how rewards become advantages (docs/rl.md): group_norm (GRPO), "
                                   "dr_grpo, rloo, reinforce (REINFORCE++), reinforce_baseline, gae (PPO with a critic)",
                                   choices=[*ADVANTAGE_ESTIMATORS, "gae"])
    init_kl_coef: float = arg(0.0, "KL(policy || reference) coefficient: in the reward per token, or with "
                              "--use_kl_loss a loss term; 0 loads no reference model (TRL's default; "
                              "OpenRLHF's is 0.01)", at_least=0)
    kl_estimator: str = arg("k1", "per-token KL estimate (k1: d, k2: d^2/2, k3: e^-d - 1 + d)",
                            choices=list(KL_ESTIMATORS))
    use_kl_loss: bool = arg(False, "the KL is a loss term (GRPO) instead of a reward penalty")
    eps_clip: float = arg(0.2, "PPO clip range of the importance ratio", above=0)
    eps_clip_low_high: list[float] | None = arg(None, "two values: DAPO's clip-higher (low, high), e.g. 0.2 0.28",
                                                above=0, special={None: "--eps_clip both sides"})
    loss_agg_mode: str = arg("token_mean", "how token losses add up to a step's loss: token_mean, "
                             "seq_mean_token_mean, seq_mean_token_sum_norm (Dr. GRPO)", choices=list(LOSS_AGG_MODES))
    gamma: float = arg(1.0, "discount of per-token rewards within a completion", at_least=0, at_most=1)
    vllm_is_correction_cap: float = arg(0.0, "truncated importance sampling: weight each token by "
                                        "min(p_trainer / p_vllm, cap)", at_least=0, special={0.0: "off"})
    reward_fn: str | None = arg(None, "rule reward: path/to/file.py:function(prompts, completions, rows) -> floats")
    remote_rm_url: str | None = arg(None, "reward server (OpenRLHF's JSON protocol: POST query/prompts/labels, "
                                    "answer {'rewards': [...]})")
    remote_rm_timeout: float = arg(60.0, "seconds a --remote_rm_url request may take before it is retried", above=0)
    reward_timeout: float = arg(300.0, "seconds one call of --reward_fn or --remote_rm_url (retries included) may "
                                "take before the run stops naming it", at_least=0,
                                special={0.0: "no limit; the function runs in the main thread"})
    ref_pretrain: str | None = arg(None, "reference model of the KL term; default: --pretrain")
    target_kl: float | None = arg(None, "adaptive KL controller (Ziegler et al.): the coefficient of the reward's KL "
                                  "penalty moves toward this KL per token", above=0,
                                  special={None: "--init_kl_coef stays fixed"})
    kl_horizon: int = arg(10000, "adaptive KL controller: completions over which the coefficient adapts", at_least=1)
    reward_pretrain: list[str] | None = arg(None, "reward models saved by openpack train_rm (one or several), scoring "
                                            "prompt + completion; their saved normalisation applies")
    reward_weights: list[float] | None = arg(None, "weights of a sum over --reward_pretrain models",
                                             special={None: "1 each"})
    reward_clip_range: list[float] | None = arg(None, "two values: rewards are clipped to [low, high], e.g. -10 10",
                                                special={None: "no clipping"})
    overlong_buffer_len: int | None = arg(None, "DAPO's overlong penalty: completions longer than "
                                          "--generate_max_len minus this lose up to --overlong_penalty_factor",
                                          at_least=1, special={None: "off"})
    overlong_penalty_factor: float = arg(1.0, "the overlong penalty at --generate_max_len tokens", at_least=0)
    dynamic_filtering: bool = arg(False, "DAPO's dynamic sampling: groups whose completions all score the same (or "
                                  "whose mean is outside --dynamic_filtering_reward_range) are dropped and replaced")
    dynamic_filtering_reward_range: list[float] | None = arg(None, "two values: keep groups whose mean reward is "
                                                             "strictly between them, e.g. 0 1",
                                                             special={None: "drop only groups of equal rewards"})
    dynamic_filtering_max_empty_steps: int | None = arg(None, "with --dynamic_filtering: stop (exit 1) after this "
                                                        "many rollout batches in a row keep no group", at_least=1,
                                                        special={None: "3 with --dynamic_filtering"})
    lambd: float = arg(1.0, "GAE's lambda (--advantage_estimator gae)", at_least=0, at_most=1)
    critic_pretrain: str | None = arg(None, "the critic's start (--advantage_estimator gae): a reward model or a "
                                      "causal LM (a new value head)",
                                      special={None: "the first --reward_pretrain, else --pretrain"})
    critic_learning_rate: float = arg(9e-6, "peak learning rate of the critic (same schedule as the policy's)",
                                      above=0)
    value_clip: float | None = arg(0.5, "the critic's value clipping: a new value moves at most this far from the "
                                   "rollout's value in the loss", above=0, special={None: "no clipping"})
    freezing_actor_steps: int = arg(0, "rollout batches that train only the critic first (GAE)", at_least=0)

    def validate(self):
        if self.eps_clip_low_high is not None and len(self.eps_clip_low_high) != 2:
            raise ConfigError(f"--eps_clip_low_high takes two values (low high), got {self.eps_clip_low_high}")
        if self.reward_fn and self.remote_rm_url or self.remote_rm_url and self.reward_pretrain:
            raise ConfigError("give one reward: --reward_fn, --remote_rm_url or --reward_pretrain (with --reward_fn "
                              "combining the reward models' scores), not two")
        for flag in ("reward_clip_range", "dynamic_filtering_reward_range"):
            value = getattr(self, flag)
            if value is not None and (len(value) != 2 or value[0] >= value[1]):
                raise ConfigError(f"--{flag} takes two values, low < high; got {value}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_pretrain or []):
            raise ConfigError(f"--reward_weights gives {len(self.reward_weights)} weight(s) for "
                              f"{len(self.reward_pretrain or [])} --reward_pretrain model(s); give one each")
        if self.dynamic_filtering_reward_range and not self.dynamic_filtering:
            raise ConfigError("--dynamic_filtering_reward_range needs --dynamic_filtering")
        if self.dynamic_filtering_max_empty_steps is not None and not self.dynamic_filtering:  # it would be ignored
            raise ConfigError(f"--dynamic_filtering_max_empty_steps {self.dynamic_filtering_max_empty_steps} stops a "
                              "run whose --dynamic_filtering keeps no group, and this run does not filter: add "
                              "--dynamic_filtering, or drop --dynamic_filtering_max_empty_steps")
        critic_only = ("critic_pretrain", "freezing_actor_steps")
        if self.advantage_estimator != "gae" and any(getattr(self, f) for f in critic_only):
            raise ConfigError(f"--critic_pretrain and --freezing_actor_steps need a critic: --advantage_estimator "
                              f"gae (got {self.advantage_estimator})")


@dataclass
class AgentConfig:
    """Multi-turn episodes (docs/agents.md): the model acts, an environment answers, until done or a limit."""

    env_file: str | None = arg(None, "a Python file defining an environment class with async reset(sample) and "
                               "async step(action), one instance per episode (docs/agents.md)",
                               special={None: "single-turn completions"})
    agent_func_path: str | None = arg(None, "an OpenRLHF agent file (AgentExecutor / AgentInstance with async "
                                      "reset(states) and step(states)), run unchanged, without openrlhf installed")
    tools: str | None = arg(None, "a Python file whose typed, documented functions become tools: shown through the "
                            "chat template, called on Hermes <tool_call> JSON; the final answer is scored by "
                            "--reward_fn, else exact match with --label_key")
    max_turns: int | None = arg(None, "actions per episode at most", at_least=1, special={None: str(agent_setup.MAX_TURNS)})
    max_episode_tokens: int | None = arg(None, "tokens of a whole episode at most (first observation included); "
                                         "each turn's generation is cut to what is left, and an episode that "
                                         "reaches it ends (counted)", at_least=2,
                                         special={None: "--prompt_max_len + --generate_max_len"})
    env_timeout: float | None = arg(None, "seconds each reset and step of an environment may take; past it the "
                                    "episode ends, counted and left out of the update", above=0, special={None: f"{agent_setup.ENV_TIMEOUT_S:g}"})
    max_env_failure_fraction: float | None = arg(None, "a rollout batch whose share of episodes that raised or "
                                                 "timed out is above this stops the run with one line", at_least=0,
                                                 at_most=1, special={None: str(agent_setup.MAX_FAILURE_FRACTION)})
    agent_concurrency: int | None = arg(None, "episodes under way at once (their turns batch into engine calls)",
                                        at_least=1, special={None: str(agent_setup.CONCURRENCY)})
    eval_prompt_data: str | None = arg(None, "held-out prompts: greedy episodes on them before and after "
                                       "training, logged as eval_success (share with reward > 0), eval_reward and "
                                       "eval_turns", special={None: "no held-out evaluation"})
    demo: str | None = arg(None, "run a built-in demo: agent (three-digit multiplication with a calculator tool, from "
                           "an SFT model trained first and cached; docs/agents.md)", choices=["agent"])
    per_turn_reward: bool = arg(False, "credit each turn's reward to its last sampled token (returns and GAE "
                                "discount from there) instead of the episode's sum at its end; needs "
                                "--advantage_estimator reinforce or gae")

    @property
    def enabled(self) -> bool:
        return bool(self.env_file or self.agent_func_path or self.tools)

    def validate(self):
        given = [f"--{name}" for name in ("env_file", "agent_func_path", "tools") if getattr(self, name)]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)}: give one environment (--tools runs the built-in tool loop)")
        limits = [f"--{name}" for name in ("max_turns", "max_episode_tokens", "env_timeout",
                                             "max_env_failure_fraction", "agent_concurrency")
                  if getattr(self, name) is not None]
        if limits and not self.enabled and not self.demo:
            raise ConfigError(f"{', '.join(limits)} bound multi-turn episodes: add --env_file, --agent_func_path or "
                              "--tools, or drop them")
        if self.eval_prompt_data and not self.enabled and not self.demo:
            raise ConfigError("--eval_prompt_data runs held-out episodes: add --env_file, --agent_func_path or "
                              "--tools, or drop it")
        if self.per_turn_reward and not self.enabled:
            raise ConfigError("--per_turn_reward credits the turns of multi-turn episodes: add --env_file, "
                              "--agent_func_path or --tools, or drop it")


@dataclass
class GRPORolloutConfig(RolloutConfig):
    n_samples_per_prompt: int = arg(8, "completions sampled per prompt (the group whose rewards are compared)",
                                    at_least=1)


@dataclass
class GRPOConfig(RLConfig):
    advantage_estimator: str = arg("group_norm", RLConfig.__dataclass_fields__["advantage_estimator"].metadata["help"],
                                   choices=[*ADVANTAGE_ESTIMATORS, "gae"])


@dataclass
class PPORunConfig(RunConfig):
    """Everything one ``openpack train_ppo`` run is told, by section; what ``run_ppo`` receives."""

    model: ModelConfig
    data: PromptDataConfig
    train: RLTrainConfig
    output: OutputConfig
    rollout: RolloutConfig
    rl: RLConfig
    launch: LaunchConfig
    agent: AgentConfig


@dataclass
class GRPORunConfig(PPORunConfig):
    """``openpack train_grpo``'s: ``train_ppo``'s sections with GRPO's defaults."""

    rollout: GRPORolloutConfig
    rl: GRPOConfig


CONFIGS = PPORunConfig.section_classes()  # the flag groups, in the order config.yaml lists them
GRPO_CONFIGS = GRPORunConfig.section_classes()


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
    """Checks that span several sections."""
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
    world = planned_world_size(launch_cfg)
    if not (train_cfg.packing_samples and train_cfg.use_dynamic_batch) and \
            train_cfg.train_batch_size % (train_cfg.micro_train_batch_size * world):
        raise ConfigError(f"--train_batch_size {train_cfg.train_batch_size} does not split into micro-batches of "
                          f"--micro_train_batch_size {train_cfg.micro_train_batch_size} on {world} rank(s); make it "
                          f"a multiple of {train_cfg.micro_train_batch_size * world}, or pass --packing_samples "
                          "--use_dynamic_batch")
    longest = episode_budget(cfg)
    if train_cfg.packing_samples and train_cfg.use_dynamic_batch and train_cfg.max_tokens_per_gpu is not None \
            and longest > train_cfg.max_tokens_per_gpu:
        what = ("an episode can be {} tokens (--max_episode_tokens)" if cfg.agent.max_episode_tokens else
                "a prompt and its completion can be {} tokens (--prompt_max_len + --generate_max_len)")
        raise ConfigError(f"{what.format(longest)}, more than --max_tokens_per_gpu {train_cfg.max_tokens_per_gpu}; "
                          "raise it or lower those")
    if (model_cfg.pretrain is None) != (data_cfg.prompt_data is None):
        raise ConfigError("give --pretrain and --prompt_data together, or neither for the built-in demo (the demo "
                          "model's tokenizer only knows the demo task's characters)")
    if rl_cfg.vllm_is_correction_cap and rollout_cfg.rollout_backend == "hf":
        raise ConfigError("--vllm_is_correction_cap corrects vLLM's sampling mismatch; with --rollout_backend hf "
                          "the policy samples itself: drop it")
    if rollout_cfg.async_train:
        from openpack.rl.worker import resolved_backend

        if resolved_backend(rollout_cfg) == "hf":
            raise ConfigError(f"--async_train overlaps vLLM's generation with training; with --rollout_backend "
                              f"{rollout_cfg.rollout_backend} (HF) the policy generates itself and nothing overlaps: "
                              "drop --async_train, or use --rollout_backend vllm")
    if world > 1:
        from openpack.rl.worker import resolved_backend

        backend = resolved_backend(rollout_cfg)
        if backend == "hf" and model_cfg.zero_stage == 3:  # ranks generate different lengths, params partitioned
            raise ConfigError(f"HF rollouts under --zero_stage 3 on {world} ranks are not supported (each rank's "
                              "generate would need the others' partitions at every token): use --rollout_backend "
                              "vllm, or --zero_stage 2")
        if backend == "vllm" and (launch_cfg.launcher != "ray" or launched_by_environment()):
            raise ConfigError(f"vLLM engines with {world} ranks run as Ray actors: use --launcher ray (not torchrun "
                              "or the deepspeed launcher; an engine inside a rank of a process group hangs), or "
                              "--rollout_backend hf")
    if rollout_cfg.colocate_all_models:
        check_colocation(rollout_cfg, world)
    check_servable(model_cfg.pretrain, rollout_cfg)
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
    if agent_cfg.per_turn_reward and (rl_cfg.overlong_buffer_len or rl_cfg.reward_clip_range):
        raise ConfigError("--per_turn_reward credits the turns' own rewards: drop --overlong_buffer_len and "
                          "--reward_clip_range, which shape an episode's one reward")
    if rl_cfg.overlong_buffer_len:
        raise ConfigError(f"{flag}: --overlong_buffer_len penalises long single completions; bound episodes with "
                          "--max_episode_tokens and --max_turns instead")
    from openpack.rl.agents.environment import EnvFileError

    try:
        _, tools = agent_environment(agent_cfg, rl_cfg.reward_fn, data_cfg.label_key)
    except EnvFileError as err:
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
    from openpack.rl.worker import resolved_backend

    if resolved_backend(rollout_cfg) != "vllm":
        return
    try:
        import_vllm()
    except RuntimeError as err:  # not installed, broken (torchvision::nms) or another minor version (also for auto)
        raise ConfigError(f"--rollout_backend {rollout_cfg.rollout_backend}: {err}") from err
    reason = unservable_reason(pretrain) if pretrain else None
    if reason:
        raise ConfigError(f"--rollout_backend vllm cannot serve --pretrain {pretrain}: {reason}. Use "
                          "--rollout_backend hf (the policy generates itself), or a model of a supported shape")


def check_colocation(rollout_cfg, world: int) -> None:
    """What --colocate_all_models cannot do: overlap anything, run without engines, or split an engine."""
    from openpack.rl.worker import resolved_backend

    if getattr(rollout_cfg, "async_train", False):
        raise ConfigError("--colocate_all_models with --async_train: on shared devices generation and training "
                          "cannot overlap; drop one")
    if resolved_backend(rollout_cfg) != "vllm":
        raise ConfigError("--colocate_all_models colocates vLLM engines; with --rollout_backend hf the policy "
                          "already generates on its own devices: drop it, or use --rollout_backend vllm")
    if rollout_cfg.ref_num_nodes:
        raise ConfigError("--colocate_all_models keeps the reference model in the training ranks: drop "
                          "--ref_num_nodes")
    if rollout_cfg.vllm_num_engines > world or rollout_cfg.vllm_tensor_parallel_size > 1:
        raise ConfigError(f"--colocate_all_models puts engine i on rank i's device: --vllm_num_engines "
                          f"{rollout_cfg.vllm_num_engines} must be at most the {world} rank(s), with "
                          "--vllm_tensor_parallel_size 1 (tensor-parallel colocated engines are not built)")


def main(argv: list[str] | None = None, command: str = "train_ppo", run_config: type = PPORunConfig) -> int:
    from openpack.data.loading import DataError
    from openpack.models.loading import ModelLoadError

    argv = sys.argv[1:] if argv is None else list(argv)
    demo_config = PPO_DEMO_CONFIG if command == "train_ppo" else DEMO_CONFIG
    if any(a == "--demo" or a.startswith("--demo=") for a in argv):
        demo_config = AGENT_DEMO_CONFIG
    argv, demo_notice = with_demo_defaults(argv, command, demo_config, data_flag="--prompt_data")
    try:
        cfg = run_config.parse(argv, f"openpack {command}", __doc__.split("\n\n")[0])
        if cfg.agent.demo:
            cfg = with_agent_demo(cfg)
        model_cfg, data_cfg, train_cfg, out_cfg, rollout_cfg, rl_cfg, launch_cfg, _ = cfg.sections()
        check_rl(cfg)
        cfg = with_prefix_sharing(cfg)
        model_cfg, data_cfg, train_cfg, out_cfg, rollout_cfg, rl_cfg, launch_cfg, _ = cfg.sections()
        check_inputs(data_cfg.prompt_data, {"--pretrain": model_cfg.pretrain, "--ref_pretrain": rl_cfg.ref_pretrain},
                     "--prompt_data", train_cfg.prefix_sharing)
        from openpack.models.reward import check_reward_model

        for path in rl_cfg.reward_pretrain or []:  # a causal LM here is refused now, not after the policy loads
            check_reward_model(path)
    except (ConfigError, DataError, ModelLoadError) as err:
        print(f"openpack {command}: {err}", file=sys.stderr)
        return 2
    announce(command, cfg, demo_notice)
    from openpack.distributed.save_path import CheckpointError, own_save_path
    from openpack.rl.worker import plan_rl, run_ppo
    from openpack.rl.agents.runner import EnvFailureError
    from openpack.rl.rewards import RewardError

    try:
        with own_save_path(out_cfg, launched_by_environment()):
            demo_model = demo_sft_model(launch_cfg, train_cfg.seed) if model_cfg.pretrain is None else None
            if demo_model is not None and rl_cfg.advantage_estimator == "gae" and not rl_cfg.reward_pretrain \
                    and not (rl_cfg.reward_fn or rl_cfg.remote_rm_url):  # the PPO demo: RM -> PPO
                from openpack.cli.train_rm import demo_rm_model

                rl_cfg.reward_pretrain = [str(demo_rm_model(launch_cfg, train_cfg.seed))]
            engines = _engine_spec(cfg, demo_model)
            return launch(run_ppo, cfg, {"demo_model": demo_model, "save_config": cfg.save},
                          functools.partial(plan_rl, cfg, demo_model=demo_model), engines=engines,
                          rewards=_reward_specs(cfg), reference=_reference_spec(cfg, demo_model))
    except (DataError, ModelLoadError, CheckpointError) as err:
        print(f"openpack {command}: {err}", file=sys.stderr)
        return 2
    except (RewardError, EnvFailureError) as err:  # a reward or environment that failed mid-run: its message
        print(f"openpack {command}: {err}", file=sys.stderr)  # names it and the batch
        return 1


def with_agent_demo(cfg: PPORunConfig) -> PPORunConfig:
    """``--demo agent``: the demo's SFT model (trained first with ``openpack train_sft`` and cached), prompts,
    held-out prompts and tools file, for the flags the user left unset (``trainers/agent_demo.py``)."""
    from openpack.cli import train_sft
    from openpack.trainers import agent_demo

    if cfg.model.pretrain or cfg.data.prompt_data or cfg.agent.enabled:
        raise ConfigError("--demo agent brings its own model, prompts and tools: drop --pretrain, --prompt_data, "
                          "--env_file, --agent_func_path and --tools")
    files, sft_argv = agent_demo.prepare(cfg.train.seed)
    if sft_argv is not None:
        print(f"openpack: training the agent demo's SFT model first (cached in {Path(files['model']).parent.parent})")
        launch_flags = ["--launcher", cfg.launch.launcher] + (["--ray_address", cfg.launch.ray_address]
                                                              if cfg.launch.ray_address else [])
        code = train_sft.main([*sft_argv, *launch_flags])
        if code != 0:  # the stage said why; its exit code is the command's
            raise SystemExit(code)
    return replace(cfg, model=replace(cfg.model, pretrain=files["model"]),
                   data=replace(cfg.data, prompt_data=[files["prompts"]], label_key="answer"),
                   agent=replace(cfg.agent, tools=files["tools"],
                                 eval_prompt_data=cfg.agent.eval_prompt_data or files["eval"]))


def _reward_specs(cfg: PPORunConfig):
    """One actor group per --reward_pretrain model when the driver is a Ray driver, unless a colocation flag keeps
    the reward models in rank 0."""
    model_cfg, train_cfg, rollout_cfg, rl_cfg, launch_cfg = cfg.model, cfg.train, cfg.rollout, cfg.rl, cfg.launch
    if not rl_cfg.reward_pretrain or launch_cfg.launcher != "ray" or launched_by_environment() or \
            rollout_cfg.colocate_critic_reward or rollout_cfg.colocate_all_models:
        return None
    from openpack.models.memory import ROW_CAP
    from openpack.orchestration.ray_launcher import ScorerGroupSpec

    cap = train_cfg.max_tokens_per_gpu or ROW_CAP  # no gradients in a reward actor: no activations kept
    return [ScorerGroupSpec(build_reward_scorer, (path, cap, model_cfg.bf16), path) for path in rl_cfg.reward_pretrain]


def _reference_spec(cfg: PPORunConfig, demo_model):
    """--ref_num_nodes 1: one reference actor (a process group of its own) when a KL needs the reference and the
    driver is a Ray driver. One, not a group: every policy rank asks it for its own share, and a ZeRO-3 group
    would need the same number of forwards from each of its ranks."""
    rollout_cfg, rl_cfg, launch_cfg = cfg.rollout, cfg.rl, cfg.launch
    if not rollout_cfg.ref_num_nodes or not rl_cfg.init_kl_coef or launch_cfg.launcher != "ray" or \
            launched_by_environment():
        return None
    from openpack.orchestration.ray_launcher import ReferenceGroupSpec
    from openpack.rl.worker import build_rl_reference

    return ReferenceGroupSpec(build_rl_reference, (cfg, cfg.model.pretrain or str(demo_model)), 1, 1)


def build_reward_scorer(path: str, max_tokens: int, bf16: bool):
    """A --reward_pretrain model on this process's device, as rank 0 builds it (module level, for Ray)."""
    import torch

    from openpack.models.reward import RewardScorer

    return RewardScorer(path, "cuda" if torch.cuda.is_available() else "cpu", max_tokens, bf16)


def _engine_spec(cfg: PPORunConfig, demo_model):
    """vLLM engines as Ray actors when the driver is a Ray driver; otherwise rank 0 starts them in-process."""
    model_cfg, rollout_cfg, train_cfg, launch_cfg, save_path = (cfg.model, cfg.rollout, cfg.train, cfg.launch,
                                                                cfg.output.save_path)
    from openpack.rl.worker import resolved_backend
    from openpack.rl.generation import vllm_options

    if resolved_backend(rollout_cfg) != "vllm" or launch_cfg.launcher != "ray" or launched_by_environment():
        return None
    from openpack.orchestration.ray_launcher import EngineGroupSpec

    options = {"seed": train_cfg.seed, **vllm_options(rollout_cfg, model_cfg.bf16, save_path)}
    return EngineGroupSpec(model_cfg.pretrain or str(demo_model), rollout_cfg.vllm_num_engines,
                           rollout_cfg.vllm_tensor_parallel_size, options, colocate=rollout_cfg.colocate_all_models)
