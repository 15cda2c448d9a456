"""``openpack train_ppo`` and ``openpack train_grpo``: online RL on packed experience, rollouts from vLLM or HF.

One command with two sets of defaults: ``train_ppo`` is PPO with a critic and
GAE, as OpenRLHF 0.11's ``train_ppo_ray``; ``train_grpo`` is ``train_ppo
--advantage_estimator group_norm --n_samples_per_prompt 8 --init_kl_coef 0``,
critic- and reference-free. With no ``--pretrain`` and no ``--prompt_data``
each runs a built-in demo from the SFT demo model (trained first and cached),
which answers the addition task right but wordily:
``train_grpo`` learns the bare form from the exact-match reward alone;
``train_ppo`` learns it from the reward-model demo's model (trained first and
cached), with a critic and GAE. Held-out exact match is reported before and
after.

This module holds the two commands' own sections (prompts, rollout, RL, agents) and their run configs, each
section with the checks of its own fields; the checks across sections are in ``rl_checks.py``. The first
paragraph above is both commands' ``--help`` description.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from openpack.config.schema import ConfigError, RunConfig, arg
from openpack.config.sections import (LaunchConfig, ModelConfig, OutputConfig, TrainConfig, check_template_flags,
                                      data_cache_dir_arg, dataset_num_proc_arg, ring_attn_size_arg)
from openpack.core.advantages import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from openpack.core.rl_losses import IS_CORRECTIONS, LOSS_AGG_MODES, POLICY_LOSSES
from openpack.rl.agents import setup as agent_setup

DESCRIPTION = __doc__.split("\n\n")[0]
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "grpo.yaml"
PPO_DEMO_CONFIG = DEMO_CONFIG.with_name("ppo.yaml")
AGENT_DEMO_CONFIG = DEMO_CONFIG.with_name("agent.yaml")


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
    data_cache_dir: str | None = data_cache_dir_arg()
    dataset_num_proc: int | None = dataset_num_proc_arg()

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
    max_tokens_per_gpu: int | None = arg(None, "token cap of a packed row under --use_dynamic_batch", at_least=2,
                                         special={None: "from the model's size and the device's memory, logged at "
                                                        "start (docs/rl.md, Row cap)"})
    prefix_sharing: bool | None = arg(None, "lay each prompt's completions out as one group prompt | completion | "
                                      "... in every training-side pass (policy, old policy, reference, critic), the "
                                      "prompt computed once; the steps train the same completions as without it "
                                      "(docs/rl.md, Prefix sharing)",
                                      special={None: "on under --packing_samples --use_dynamic_batch, unless the "
                                                     "policy's rope frequencies depend on length or --ring_attn_size "
                                                     "splits rows; off otherwise"})
    ring_attn_size: int | None = ring_attn_size_arg()


@dataclass
class RolloutConfig:
    rollout_backend: str = arg("auto", "who generates: vllm (engine actors, weights synced after every update), hf "
                               "(transformers' generate in the training ranks), auto (vllm if it imports, else hf)",
                               choices=["auto", "vllm", "hf"])
    vllm_num_engines: int = arg(1, "vLLM engines (Ray actors under --launcher ray; in rank 0's process otherwise)",
                                at_least=1)
    vllm_tensor_parallel_size: int = arg(1, "GPUs per vLLM engine", at_least=1)
    vllm_gpu_memory_utilization: float = arg(0.95, "share of a GPU's memory vLLM may take (weights + KV cache)",
                                             above=0, at_most=1)
    vllm_sync_backend: str = arg("inhost", "how weights reach the engines: inhost (tensors through Ray or the "
                                 "process: works everywhere, the CPU path) or nccl (broadcast from rank 0 into the "
                                 "engines' GPUs: multi-node GPUs; not run on hardware yet)", choices=["inhost", "nccl"])
    rollout_batch_size: int = arg(1024, "prompts per rollout batch", at_least=1)
    n_samples_per_prompt: int = arg(1, "completions sampled per prompt", at_least=1)
    micro_rollout_batch_size: int = arg(32, "prompts per generate call with --rollout_backend hf", at_least=1)
    generate_max_len: int = arg(1024, "most tokens a completion may have", at_least=1)
    max_len: int | None = arg(None, "prompt + completion tokens at most: a completion may take what its prompt "
                              "leaves, up to --generate_max_len (OpenRLHF's --max_len; 0.11's --data.max_len)",
                              at_least=2, special={None: "no shared budget (--prompt_max_len + --generate_max_len)"})
    temperature: float = arg(1.0, "sampling temperature (log-probs are scored at temperature 1 either way)", above=0)
    top_p: float = arg(1.0, "nucleus sampling: the smallest set of tokens with this much probability", above=0,
                       at_most=1)
    num_episodes: int = arg(1, "passes over the prompts", at_least=1)
    async_train: bool = arg(False, "generate the next rollout batches with the current weights while training on "
                            "this one (vLLM engines; docs/rl.md, Asynchronous training)")
    max_staleness: int | None = arg(None, "with --async_train: rollout batches generated ahead of training, so the "
                                    "most policy versions between sampling a rollout and training on it (0: the "
                                    "synchronous loop)", at_least=0, special={None: "1 with --async_train"})
    partial_rollout: bool = arg(False, "with --async_train: a weight update lands while vLLM generates, and the "
                                "completions under way continue with the new weights (each token keeps the "
                                "version that sampled it; docs/rl.md, Partial rollouts)")
    colocate_all_models: bool = arg(False, "policy, reference, reward models and vLLM share the training ranks' "
                                    "devices, taking turns: vLLM sleeps while DeepSpeed trains, DeepSpeed's states "
                                    "are offloaded while vLLM generates (docs/rl.md, Placement)")
    colocate_critic_reward: bool = arg(False, "the reward models run inside the training ranks, on rank 0, next to "
                                       "the critic, instead of their own actor group (--launcher ray)")
    ref_num_nodes: int = arg(0, "the reference model (a KL needs one) in a Ray actor of its own, one process on "
                             "one node, which every rank asks for its share (train_dpo's flag)", at_least=0, at_most=1,
                             special={0: "in every training rank"})
    teacher_num_nodes: int = arg(0, "the distillation teacher (--teacher_pretrain) in a Ray actor of its own, one "
                                 "process on one node, which every rank asks for its share (as --ref_num_nodes)",
                                 at_least=0, at_most=1, special={0: "in every training rank"})

    def validate(self):
        if self.max_staleness is not None and not self.async_train:  # it would be ignored: the loop is synchronous
            raise ConfigError(f"--max_staleness {self.max_staleness} bounds how far generation runs ahead of "
                              "training under --async_train, and this run is synchronous: add --async_train, or "
                              "drop --max_staleness")
        if self.partial_rollout and not self.async_train:
            raise ConfigError("--partial_rollout lets a weight update land in generation that runs beside training, "
                              "and this run is synchronous: add --async_train, or drop --partial_rollout")
        if self.partial_rollout and self.max_staleness == 0:
            raise ConfigError("--partial_rollout with --max_staleness 0: no generation is under way when weights "
                              "land, so nothing is partial; raise --max_staleness, or drop --partial_rollout")


@dataclass
class RLConfig:
    advantage_estimator: str = arg("gae", "how rewards become advantages (docs/rl.md): group_norm (GRPO), "
                                   "dr_grpo, rloo, reinforce (REINFORCE++), reinforce_baseline, gae (PPO with a critic)",
                                   choices=[*ADVANTAGE_ESTIMATORS, "gae"])
    init_kl_coef: float = arg(0.01, "KL(policy || reference) coefficient: in the reward per token, or with "
                              "--use_kl_loss a loss term (OpenRLHF's default); 0: no KL term, and no reference "
                              "model is loaded", at_least=0)
    kl_estimator: str = arg("k1", "per-token KL estimate (k1: d, k2: d^2/2, k3: e^-d - 1 + d)",
                            choices=list(KL_ESTIMATORS))
    use_kl_loss: bool = arg(False, "the KL is a loss term (GRPO) instead of a reward penalty")
    policy_loss_type: str | None = arg(None, "the policy loss (docs/rl.md, 'KL and the loss'): ppo (clipped token "
                                       "ratio), gspo (one clipped ratio per completion, GSPO-token), cispo (clipped, "
                                       "detached weight times the log-prob)", choices=list(POLICY_LOSSES),
                                       special={None: "ppo"})
    eps_clip: float = arg(0.2, "PPO clip range of the importance ratio", above=0)
    eps_clip_low_high: list[float] | None = arg(None, "two values: the clip range below and above 1 (DAPO's "
                                                "clip-higher: 0.2 0.28)", above=0,
                                                special={None: "ppo: --eps_clip both sides; gspo: 3e-4 4e-4 (the "
                                                         "GSPO paper); cispo: none below, 4 above (weights <= 5)"})
    dual_clip: float | None = arg(None, "dual-clip PPO (Ye et al. 2020): a token with a negative advantage loses at "
                                  "most this times |A| (ppo, gspo)", above=1, special={None: "off"})
    entropy_coef: float = arg(0.0, "entropy bonus: loss -= coef x each token's entropy (with its gradient)",
                              at_least=0, special={0.0: "off; the entropy is still logged"})
    loss_agg_mode: str = arg("token_mean", "how token losses add up to a step's loss: token_mean, "
                             "seq_mean_token_mean, seq_mean_token_sum_norm (Dr. GRPO)", choices=list(LOSS_AGG_MODES))
    gamma: float = arg(1.0, "discount of per-token rewards within a completion", at_least=0, at_most=1)
    vllm_is_correction_cap: float = arg(0.0, "truncated importance sampling: weight each token by "
                                        "min(p_trainer / p_vllm, cap); the same as --is_correction_type tis "
                                        "--is_correction_threshold 0 CAP", at_least=0, special={0.0: "off"})
    is_correction_type: str | None = arg(None, "rollout correction of the trainer/vLLM mismatch (docs/rl.md): tis "
                                         "(truncate each token's ratio to the band), icepop (mask tokens outside "
                                         "it), seq-mask-tis (mask completions whose geometric-mean ratio is "
                                         "outside it, tis on the rest)", choices=list(IS_CORRECTIONS),
                                         special={None: "off"})
    is_correction_threshold: list[float] | None = arg(None, "two values: the band [low, high] of the trainer/vLLM "
                                                      "ratio, for --is_correction_type", at_least=0,
                                                      special={None: "0.5 5 (OpenRLHF's)"})
    reward_fn: str | None = arg(None, "rule reward: path/to/file.py:function(prompts, completions, rows) -> floats")
    remote_rm_url: str | None = arg(None, "reward server (OpenRLHF's JSON protocol: POST query/prompts/labels, "
                                    "answer {'rewards': [...]}), or OpenRLHF's reward file: a .py defining "
                                    "reward_func(queries, prompts, labels, **kwargs)")
    remote_rm_timeout: float = arg(60.0, "seconds a --remote_rm_url request may take before it is retried", above=0)
    reward_timeout: float = arg(300.0, "seconds one call of --reward_fn or --remote_rm_url (retries included) may "
                                "take before the run stops naming it", at_least=0,
                                special={0.0: "no limit; the function runs in the main thread"})
    ref_pretrain: str | None = arg(None, "reference model of the KL term; default: --pretrain")
    teacher_pretrain: str | None = arg(None, "on-policy distillation: this model, which must share the policy's "
                                       "tokenizer, scores the policy's own samples, and each sampled token's "
                                       "advantage gains --distill_coef x (log teacher - log policy); alone when no "
                                       "reward is given (docs/rl.md, On-policy distillation)",
                                       special={None: "no distillation"})
    distill_coef: float | None = arg(None, "weight of the teacher's per-token term in the advantages", above=0,
                                     special={None: "1 with --teacher_pretrain"})
    teacher_offload: bool = arg(False, "keep the teacher's parameters on the CPU (ZeRO-3 parameter offload; needs "
                                "--zero_stage 3)")
    target_kl: float | None = arg(None, "adaptive KL controller (Ziegler et al.): the coefficient of the reward's KL "
                                  "penalty moves toward this KL per token", above=0,
                                  special={None: "--init_kl_coef stays fixed"})
    kl_horizon: int = arg(10000, "adaptive KL controller: completions over which the coefficient adapts", at_least=1)
    reward_pretrain: list[str] | None = arg(None, "reward models saved by openpack train_rm (one or several), scoring "
                                            "prompt + completion; their saved normalisation applies")
    reward_weights: list[float] | None = arg(None, "weights of a sum over --reward_pretrain models",
                                             special={None: "1 each"})
    reward_clip_range: list[float] | None = arg([-10.0, 10.0], "two values: rewards (an episode's, or each turn's "
                                                "with --per_turn_reward) are clipped to [low, high] (OpenRLHF's "
                                                "default)", special={None: "no clipping"})
    overlong_buffer_len: int | None = arg(None, "DAPO's overlong penalty: completions longer than "
                                          "--generate_max_len minus this lose up to --overlong_penalty_factor",
                                          at_least=1, special={None: "off"})
    overlong_penalty_factor: float = arg(1.0, "the overlong penalty at --generate_max_len tokens", at_least=0)
    stop_properly_penalty_coef: float | None = arg(None, "ProRL's penalty for a completion cut at its token budget "
                                                   "(no stop token): its reward times this, in [0, 1], or a "
                                                   "negative value as its reward", at_most=1,
                                                   special={None: "off"})
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
        low_high = self.is_correction_threshold
        if low_high is not None and (len(low_high) != 2 or low_high[0] > low_high[1] or low_high[1] <= 0):
            raise ConfigError(f"--is_correction_threshold takes two values, low <= high and high > 0; got {low_high}")
        if low_high is not None and not self.is_correction_type:
            raise ConfigError("--is_correction_threshold is the band of --is_correction_type: add one, or drop it")
        if self.is_correction_type and self.vllm_is_correction_cap:
            raise ConfigError(f"--vllm_is_correction_cap {self.vllm_is_correction_cap:g} is --is_correction_type tis "
                              f"with a band of 0 to the cap; give one of the two")
        if self.dual_clip is not None and self.policy_loss_type == "cispo":
            raise ConfigError("--dual_clip bounds a clipped ratio's loss, and --policy_loss_type cispo clips no "
                              "ratio (its weight is detached): drop one")
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
        if not self.teacher_pretrain and (self.distill_coef is not None or self.teacher_offload):
            raise ConfigError(f"{'--distill_coef' if self.distill_coef is not None else '--teacher_offload'} "
                              "shapes on-policy distillation, and this run has no teacher: add --teacher_pretrain "
                              "PATH, or drop it")
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
        if self.per_turn_reward and not self.enabled:
            raise ConfigError("--per_turn_reward credits the turns of multi-turn episodes: add --env_file, "
                              "--agent_func_path or --tools, or drop it")


@dataclass
class EvalConfig:
    """Held-out evaluation during training (docs/rl.md, Evaluation): the engines sample each held-out prompt with
    the current weights before training, every --eval_steps rollout batches and at the end; pass@1 and pass@k of
    each reward source (an agent run's: its episodes) are logged."""

    eval_prompt_data: str | None = arg(None, "held-out prompts (a local file or HF name, the --prompt_data keys): "
                                       "sampled and scored before training, every --eval_steps and at the end, "
                                       "logged as eval/<source>/pass@k; agent runs also log eval_success (share "
                                       "with reward > 0), eval_reward and eval_turns",
                                       special={None: "no held-out evaluation"})
    eval_steps: int | None = arg(None, "evaluate every N rollout batches too", at_least=1,
                                 special={None: "before and after training only"})
    eval_n_samples_per_prompt: int | None = arg(4, "completions (episodes) sampled per held-out prompt: pass@k "
                                                "is logged for k = 1, 2, 4, ... and this n (OpenRLHF's default)",
                                                at_least=1,
                                                special={None: "1"})
    eval_temperature: float | None = arg(0.6, "sampling temperature of the evaluation (0: greedy, one sample a "
                                         "prompt; OpenRLHF's default)", at_least=0,
                                         special={None: "0 (greedy) with one sample a prompt, else --temperature"})
    eval_pass_threshold: float | None = arg(None, "a sample passes (is correct for pass@k) when its reward from a "
                                            "source is above this",
                                            special={None: "0: exact match's 1 passes and 0 fails; an episode "
                                                           "passes when it succeeds (reward > 0)"})
    best_metric_key: str | None = arg(None, "an evaluation metric, e.g. eval/reward/pass@1: the policy of the "
                                      "evaluation where it was highest is kept in <save_path>/best besides the "
                                      "latest checkpoint", special={None: "no best checkpoint"})

    @property
    def samples(self) -> int:
        """Samples a held-out prompt gets."""
        return self.eval_n_samples_per_prompt or 1

    def temperature(self, training: float) -> float:
        """The temperature the evaluation samples at (``training``: --temperature)."""
        if self.eval_temperature is not None:
            return self.eval_temperature
        return 0.0 if self.samples == 1 else training

    def given(self) -> list[str]:
        """The flags that shape an evaluation set away from their defaults: refused without --eval_prompt_data
        (``rl_checks``; the agent demo brings its own held-out prompts)."""
        defaults = {f.name: f.default for f in fields(self)}
        return [f"--{name}" for name in ("eval_steps", "eval_n_samples_per_prompt", "eval_temperature",
                                          "eval_pass_threshold", "best_metric_key")
                if getattr(self, name) != defaults[name]]

    def validate(self):
        if self.eval_temperature == 0 and self.samples > 1:
            raise ConfigError(f"--eval_temperature 0 is greedy: --eval_n_samples_per_prompt {self.samples} would "
                              "repeat one completion; raise the temperature or sample one")


@dataclass
class GRPORolloutConfig(RolloutConfig):
    n_samples_per_prompt: int = arg(8, "completions sampled per prompt (the group whose rewards are compared)",
                                    at_least=1)


@dataclass
class GRPOConfig(RLConfig):
    advantage_estimator: str = arg("group_norm", RLConfig.__dataclass_fields__["advantage_estimator"].metadata["help"],
                                   choices=[*ADVANTAGE_ESTIMATORS, "gae"])
    init_kl_coef: float = arg(0.0, "KL(policy || reference) coefficient: in the reward per token, or with "
                              "--use_kl_loss a loss term; 0 loads no reference model (TRL's GRPO default; "
                              "train_ppo's is OpenRLHF's 0.01)", at_least=0)


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
    evaluation: EvalConfig


@dataclass
class GRPORunConfig(PPORunConfig):
    """``openpack train_grpo``'s: ``train_ppo``'s sections with GRPO's defaults."""

    rollout: GRPORolloutConfig
    rl: GRPOConfig


CONFIGS = PPORunConfig.section_classes()  # the flag groups, in the order config.yaml lists them
GRPO_CONFIGS = GRPORunConfig.section_classes()
