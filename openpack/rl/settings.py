"""What one RL step needs of the flags, in one object: ``RLSettings``, built by keyword from the run's rl, rollout
and train sections by ``rl_settings`` (the sections hold the flags with their help). The step never reads a
section itself, so everything below ``rl/worker.py`` sees typed values, not the run config."""

from __future__ import annotations

from dataclasses import dataclass, field

from openpack.core.rl_losses import DEFAULT_CLIP, DEFAULT_IS_THRESHOLD, PolicyLossParams
from openpack.core.schedule import Batching
from openpack.trainers.batching import batching


@dataclass
class RLSettings:
    """What the step needs of the RL and train flags."""

    n_samples_per_prompt: int
    advantage_estimator: str
    loss_agg_mode: str
    generate_max_len: int
    policy: PolicyLossParams
    kl_coef: float  # --init_kl_coef
    use_kl_loss: bool
    # how a rollout batch is trained (--train_batch_size completions a step, --max_epochs passes, packed rows)
    seed: int = 42
    batching: Batching = field(default_factory=Batching)  # the update's micro-batches (trainers/batching.py)
    packing_samples: bool = False
    prefix_sharing: bool = False
    max_tokens_per_gpu: int | None = None  # the row cap of scoring passes and shared units
    train_batch_size: int = 1
    max_epochs: int = 1
    gamma: float = 1.0
    updates_per_rollout: int = 1  # optimizer steps per rollout batch over all PPO epochs
    lambd: float = 1.0  # GAE
    value_clip: float | None = None
    freezing_actor_steps: int = 0  # rollout batches that train only the critic
    overlong_buffer_len: int | None = None  # DAPO's overlong penalty
    overlong_penalty_factor: float = 1.0
    stop_properly_penalty_coef: float | None = None  # ProRL's penalty for truncated completions
    reward_clip_range: tuple[float, float] | None = None
    dynamic_filtering: bool = False  # DAPO's dynamic sampling
    dynamic_filtering_reward_range: tuple[float, float] | None = None
    dynamic_filtering_max_empty_steps: int = 3  # rollout batches in a row that keep no group: stop
    async_staleness: int = 0  # --max_staleness under --async_train: rollouts may be this many versions old
    per_turn_reward: bool = False  # episodes: each turn's reward at its last sampled token (reinforce, gae)
    distill_coef: float = 0.0  # --teacher_pretrain's --distill_coef: the teacher's per-token term; 0 without one

    @property
    def critic(self) -> bool:
        """PPO with a learned value function (GAE) rather than a critic-free estimator."""
        return self.advantage_estimator == "gae"

    @property
    def reward_kl(self) -> bool:
        """A KL penalty in the reward (OpenRLHF's default), rather than a loss term."""
        return self.kl_coef > 0 and not self.use_kl_loss

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def distills(self) -> bool:
        """On-policy distillation: a teacher scores the completions, its reverse KL a per-token advantage."""
        return self.distill_coef > 0

    @property
    def needs_old_pass(self) -> bool:
        """A scoring pass of the policy before its updates: the ratio's denominator once an update has moved the
        policy (more than one update per rollout batch), or the log-probs a KL in the reward needs first.

        With one update per batch the denominator is the policy as it stands before that update, and the update's
        own forward computes exactly those log-probs (detached): also when the batch was sampled by an older
        version (``--async_train``), whose log-probs stay the behaviour log-probs of TIS and ``vllm_logp_diff``.
        Distillation needs them before any update too: the student's side of each token's reverse KL.
        """
        return self.updates_per_rollout > 1 or self.reward_kl or self.distills


def rl_settings(cfg) -> RLSettings:
    """The step's settings from the run config's ``rollout``, ``rl``, ``train`` (and ``agent``) sections."""
    rollout_cfg, rl_cfg, train_cfg = cfg.rollout, cfg.rl, cfg.train
    loss_type = rl_cfg.policy_loss_type or "ppo"
    low, high = rl_cfg.eps_clip_low_high or DEFAULT_CLIP.get(loss_type, (rl_cfg.eps_clip, rl_cfg.eps_clip))
    correction = rl_cfg.is_correction_type
    correction_low, correction_high = rl_cfg.is_correction_threshold or DEFAULT_IS_THRESHOLD
    if rl_cfg.vllm_is_correction_cap:  # its alias: token TIS below the cap
        correction, correction_low, correction_high = "tis", 0.0, rl_cfg.vllm_is_correction_cap
    policy = PolicyLossParams(eps_low=low, eps_high=high, kl_coef=rl_cfg.init_kl_coef if rl_cfg.use_kl_loss else 0.0,
                              kl_estimator=rl_cfg.kl_estimator, loss_type=loss_type, dual_clip=rl_cfg.dual_clip,
                              entropy_coef=rl_cfg.entropy_coef, correction=correction,
                              correction_low=correction_low, correction_high=correction_high)
    return RLSettings(
        n_samples_per_prompt=rollout_cfg.n_samples_per_prompt, advantage_estimator=rl_cfg.advantage_estimator,
        loss_agg_mode=rl_cfg.loss_agg_mode, generate_max_len=rollout_cfg.generate_max_len, policy=policy,
        kl_coef=rl_cfg.init_kl_coef, use_kl_loss=rl_cfg.use_kl_loss,
        seed=train_cfg.seed, batching=batching(train_cfg), packing_samples=train_cfg.packing_samples,
        prefix_sharing=train_cfg.prefix_sharing, max_tokens_per_gpu=train_cfg.max_tokens_per_gpu,
        train_batch_size=train_cfg.train_batch_size, max_epochs=train_cfg.max_epochs,
        gamma=rl_cfg.gamma, updates_per_rollout=updates_per_rollout(rollout_cfg, train_cfg), lambd=rl_cfg.lambd,
        value_clip=rl_cfg.value_clip, freezing_actor_steps=rl_cfg.freezing_actor_steps,
        overlong_buffer_len=rl_cfg.overlong_buffer_len, overlong_penalty_factor=rl_cfg.overlong_penalty_factor,
        stop_properly_penalty_coef=rl_cfg.stop_properly_penalty_coef,
        reward_clip_range=_pair(rl_cfg.reward_clip_range), dynamic_filtering=rl_cfg.dynamic_filtering,
        dynamic_filtering_reward_range=_pair(rl_cfg.dynamic_filtering_reward_range),
        dynamic_filtering_max_empty_steps=(rl_cfg.dynamic_filtering_max_empty_steps
                                           or RLSettings.dynamic_filtering_max_empty_steps),
        async_staleness=async_staleness(rollout_cfg),
        per_turn_reward=bool(getattr(cfg, "agent", None) and cfg.agent.per_turn_reward),
        distill_coef=distill_coef(rl_cfg))


def distill_coef(rl_cfg) -> float:
    """The teacher's weight: --distill_coef (none given: 1) with --teacher_pretrain, else 0 (no distillation)."""
    if not rl_cfg.teacher_pretrain:
        return 0.0
    return 1.0 if rl_cfg.distill_coef is None else rl_cfg.distill_coef


def _pair(values: list[float] | None) -> tuple[float, float] | None:
    return tuple(values) if values else None


def updates_per_rollout(rollout_cfg, train_cfg) -> int:
    """Optimizer steps per rollout batch: its completions in steps of --train_batch_size, --max_epochs times."""
    return rollout_cfg.rollout_batch_size * rollout_cfg.n_samples_per_prompt // train_cfg.train_batch_size \
        * train_cfg.max_epochs


def async_staleness(rollout_cfg) -> int:
    """How many rollout batches generation runs ahead: --max_staleness (none: 1) under --async_train, else 0."""
    if not rollout_cfg.async_train:
        return 0
    return 1 if rollout_cfg.max_staleness is None else rollout_cfg.max_staleness
