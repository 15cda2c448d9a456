"""Advantages for online RL: critic-free estimators behind a registry keyed by name, GAE for PPO with a critic,
KL estimators and controllers, and DAPO's reward shaping.

A rollout batch holds ``B = prompts x n`` completions, the n completions of a
prompt contiguous (group g is rows ``[g n, (g + 1) n)``), each with one scalar
reward r. Per completion, with mean_g and std_g (unbiased) over its group::

    group_norm          (r - mean_g) / (std_g + eps)          GRPO (Shao et al. 2024)
    dr_grpo             r - mean_g                            Dr. GRPO: no std (Liu et al. 2025)
    rloo                r - mean of the other n - 1 = n / (n - 1) (r - mean_g)     (Ahmadian et al. 2024)
    reinforce_baseline  r - mean_g, then whitened over the batch's tokens   (REINFORCE++-baseline)
    reinforce           r, then whitened over the batch's tokens            (REINFORCE++, Hu 2025)

The scalar lands on the completion's last token; a KL penalty in the reward
(``-kl_coef * kl_t`` on every response token, when the KL is not a loss term)
is added, and the token-level return is the (undiscounted by default) sum
from a token to the end of its completion, as OpenRLHF computes it. The two
REINFORCE estimators then whiten the returns over every response token of
the batch (``whiten``); a trainer with several ranks passes the batch's
global sums so every rank whitens alike.

KL estimators of KL(policy || reference) per token, with
``d = logp - ref_logp`` (Schulman, "Approximating KL divergence")::

    k1  d                  unbiased, can be negative
    k2  d^2 / 2            biased, low variance
    k3  exp(-d) - 1 + d    unbiased, non-negative

PPO with a critic (Schulman et al. 2017; GAE, Schulman et al. 2016), as
OpenRLHF and TRL compute it. Per completion, r_t is ``token_rewards`` (the
penalty at every token, the scalar added at the last) and V_t the critic's
value of the state before response token t, V = 0 after the last token::

    delta_t   = r_t + gamma V_{t+1} - V_t
    A_t       = delta_t + gamma lambd A_{t+1}       (A = 0 after the last token)
    returns_t = A_t + V_t                          the critic's target

lambd = 1 gives A_t = (discounted return) - V_t, lambd = 0 the one-step TD error.
The KL coefficient in the reward is fixed, or adapted toward ``target_kl``
(Ziegler et al. 2019)::

    value *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) n_steps / horizon

Reward shaping from DAPO (Yu et al. 2025). Soft overlong punishment of a
response of ``length`` tokens, with expected = generate_max_len - buffer_len::

    penalty = -min(max(length - expected, 0), buffer_len) / buffer_len x factor

0 up to ``expected``, linear down to -factor at generate_max_len. Dynamic
sampling keeps only the groups whose rewards differ (``keep_groups``).

ProRL v2's stop-properly penalty (NVIDIA 2025, as OpenRLHF 0.11 applies it after the overlong penalty and before
clipping) for a response cut at its token budget instead of ending on a stop token::

    reward = reward x coef     (truncated, coef in [0, 1]; 0: a truncated response earns nothing)
    reward = coef              (truncated, coef < 0: a fixed penalty)

On-policy distillation (Agarwal et al. 2024, GKD; Lu / Thinking Machines
2025): a teacher nu scores the student's own sampled tokens, and each token's
advantage gains ``coef x (log nu(y_t) - log pi(y_t))``, the negative
single-sample (k1) estimate of the reverse KL(pi || nu) at that token's state,
with pi the student before the update (the ratio's denominator). The term is
the token's own, added after the estimator: not summed over later tokens
(discount 0, as Thinking Machines and verl's policy-gradient distillation),
not whitened, not grouped. Since E_{y~pi}[grad log pi(y)] = 0, its policy
gradient at a state is exactly -coef x grad KL(pi(.|s_t) || nu(.|s_t)) there::

    student logp  [-1.0, -2.0, -0.5]    teacher logp [-1.5, -1.0, -0.5]    coef 0.5
    advantage    += [-0.25, 0.5, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

GROUP_EPS = 1e-6  # group_norm's std guard: a group whose rewards are all equal gets zero advantage


def _grouped(rewards: Tensor, n: int) -> Tensor:
    if rewards.dim() != 1 or rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n_samples_per_prompt {n}")
    return rewards.view(-1, n)


def _group_norm(rewards: Tensor, n: int) -> Tensor:
    groups = _grouped(rewards, n)
    std = groups.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + GROUP_EPS)).flatten()


def _centered(rewards: Tensor, n: int) -> Tensor:
    groups = _grouped(rewards, n)
    return (groups - groups.mean(dim=1, keepdim=True)).flatten()


def _rloo(rewards: Tensor, n: int) -> Tensor:
    if n < 2:
        raise ValueError("rloo needs n_samples_per_prompt >= 2: each completion's baseline is the others' mean")
    return _centered(rewards, n) * n / (n - 1)


SequenceAdvantage = Callable[[Tensor, int], Tensor]
# name -> (per-completion scalar from the rewards, whether token returns are whitened over the batch afterwards)
ADVANTAGE_ESTIMATORS: dict[str, tuple[SequenceAdvantage, bool]] = {
    "group_norm": (_group_norm, False),
    "dr_grpo": (_centered, False),
    "rloo": (_rloo, False),
    "reinforce_baseline": (_centered, True),
    "reinforce": (lambda rewards, n: _grouped(rewards, n).flatten(), True),
}

KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda d: d,
    "k2": lambda d: d.square() / 2,
    "k3": lambda d: torch.expm1(-d) + d,
}


def sequence_advantages(rewards: Tensor, n: int, estimator: str) -> Tensor:
    """The per-completion scalar of ``estimator`` ``[B]`` (before KL shaping and whitening)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; registered: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator][0](rewards.double(), n).float()


def whitens(estimator: str) -> bool:
    """True for the estimators whose token returns are whitened over the batch (the REINFORCE family)."""
    return ADVANTAGE_ESTIMATORS[estimator][1]


def kl(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL(policy || reference) estimate from the two log-probs of the sampled tokens."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; registered: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp - ref_logp)


def _last_tokens(segment_ids: Tensor) -> Tensor:
    """[N] bool: the token is its completion's last (its next token belongs to another completion, or none follows)."""
    last = torch.zeros_like(segment_ids, dtype=torch.bool)
    last[:-1] = segment_ids[1:] != segment_ids[:-1]
    last[-1:] = True
    return last


def _discounted_sums(values: list[float], ends: list[bool], discount: float) -> list[float]:
    """x_t + discount x_{t+1} + discount^2 x_{t+2} + ... up to the end of t's completion (a reverse scan in plain
    floats, ~20 ms per 100k tokens)."""
    sums, running = [0.0] * len(values), 0.0
    for t in range(len(values) - 1, -1, -1):
        running = values[t] + (0.0 if ends[t] else discount * running)  # the sum restarts at each completion's end
        sums[t] = running
    return sums


def token_rewards(scalar: Tensor, segment_ids: Tensor, token_penalty: Tensor | None = None) -> Tensor:
    """Reward of every response token [N] float64: its penalty (or 0), plus the completion's scalar at its last token.

    ``scalar`` [S] is each completion's scalar (reward or advantage scalar); ``segment_ids`` [N] names each response
    token's completion (its tokens contiguous, in order); ``token_penalty`` [N] is e.g. ``-kl_coef * kl``::

        segment_ids  [0,   0,   0,  1,  1 ]    scalar [1, -2]    token_penalty [.1, .2, .3, .4, .5]
        rewards      [.1, .2, 1.3, .4, -1.5]
    """
    rewards = torch.zeros_like(segment_ids, dtype=torch.float64) if token_penalty is None else token_penalty.double()
    last = _last_tokens(segment_ids)
    if int(last.sum()) != scalar.numel():
        raise ValueError(f"{scalar.numel()} completions' scalars for {int(last.sum())} completions in segment_ids")
    return rewards.index_add(0, last.nonzero()[:, 0], scalar.double().to(rewards.device))


def token_returns(scalar: Tensor, segment_ids: Tensor, token_penalty: Tensor | None = None,
                  gamma: float = 1.0) -> Tensor:
    """Return of every response token [N]: its reward (``token_rewards``) plus every later one in its completion,
    discounted by ``gamma``."""
    rewards = token_rewards(scalar, segment_ids, token_penalty)
    returns = _discounted_sums(rewards.tolist(), _last_tokens(segment_ids).tolist(), gamma)
    return torch.tensor(returns, dtype=torch.float32, device=segment_ids.device)


def gae(rewards: Tensor, values: Tensor, segment_ids: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns), each [N] float32, by generalized advantage estimation (module docstring).

    ``rewards`` [N] from ``token_rewards``; ``values`` [N] the critic's value of the state before each response token
    (rollout time); ``segment_ids`` [N] as in ``token_rewards``. Computed in float64.
    """
    last = _last_tokens(segment_ids)
    values = values.double()
    next_values = torch.zeros_like(values)
    next_values[:-1] = values[1:]
    next_values[last] = 0.0  # nothing follows a completion's last token
    deltas = rewards.double() + gamma * next_values - values
    advantages = torch.tensor(_discounted_sums(deltas.tolist(), last.tolist(), gamma * lambd),
                              dtype=torch.float64, device=values.device)
    return advantages.float(), (advantages + values).float()


class AdaptiveKLController:
    """The KL coefficient adapted toward ``target_kl`` (Ziegler et al. 2019, as OpenRLHF and TRL): up when the
    measured KL is above it, down when below, at most 20% of ``n_steps / horizon`` per update."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon < 1:
            raise ValueError(f"the adaptive KL controller needs target_kl > 0 and kl_horizon >= 1 "
                             f"(got {target_kl}, {horizon}); leave target_kl unset for a fixed coefficient")
        self.value, self.target_kl, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class FixedKLController:
    """The KL coefficient held at ``init_kl_coef``; the same interface as ``AdaptiveKLController``."""

    def __init__(self, init_kl_coef: float):
        self.value = init_kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        pass  # the coefficient is the user's flag; a checkpoint does not override it


def kl_controller(init_kl_coef: float, target_kl: float | None,
                  horizon: int) -> AdaptiveKLController | FixedKLController:
    """The adaptive controller when ``target_kl`` is given, else the fixed one."""
    if target_kl is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target_kl, horizon)


def distill_advantages(student_logp: Tensor, teacher_logp: Tensor, coef: float) -> Tensor:
    """Each sampled token's distillation advantage [N] float32 (module docstring): ``coef x (teacher - student)``
    from the two log-probs [N] of the tokens the student sampled, computed in float64."""
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(f"student log-probs {tuple(student_logp.shape)} and teacher log-probs "
                         f"{tuple(teacher_logp.shape)} must score the same tokens")
    return (coef * (teacher_logp.double() - student_logp.double())).float()


def overlong_penalty(lengths: Tensor, generate_max_len: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment [B] float32 of responses ``lengths`` [B] tokens long (module docstring)."""
    if not 1 <= buffer_len < generate_max_len:
        raise ValueError(f"the overlong buffer ({buffer_len} tokens) must be at least 1 and shorter than "
                         f"generate_max_len ({generate_max_len})")
    excess = (lengths.double() - (generate_max_len - buffer_len)).clamp(0, buffer_len)
    return (-excess / buffer_len * factor).float()


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """ProRL's penalty (module docstring): ``rewards`` [B] with each truncated [B] bool response's reward scaled by
    ``coef`` in [0, 1], or replaced by a negative ``coef``."""
    if coef > 1:
        raise ValueError(f"the stop-properly coefficient scales a reward by [0, 1] or, negative, replaces it; "
                         f"got {coef}")
    penalised = torch.full_like(rewards, coef) if coef < 0 else rewards * coef
    return torch.where(truncated, penalised, rewards)


def clip_rewards(rewards: Tensor, low_high: tuple[float, float] | None) -> Tensor:
    """``rewards`` clamped to [low, high]; unchanged when ``low_high`` is None."""
    return rewards if low_high is None else rewards.clamp(*low_high)


def keep_groups(rewards: Tensor, n: int, reward_range: tuple[float, float] | None = None) -> Tensor:
    """DAPO's dynamic sampling: [B // n] bool, True for a group (n contiguous completions of a prompt) whose rewards
    are not all equal and, with ``reward_range`` (low, high), whose mean is strictly inside it.

    OpenRLHF's ``--dynamic_filtering_reward_range`` tests the mean alone; for 0/1 rewards and (0, 1) the two agree
    (an all-equal group has mean 0 or 1). For other scales this also drops a constant group whose mean is in range:
    it carries no signal to a group baseline.
    """
    if n < 2:
        raise ValueError("dynamic sampling needs n_samples_per_prompt >= 2: a group of one is always all-equal")
    groups = _grouped(rewards, n).double()
    keep = (groups != groups[:, :1]).any(dim=1)
    if reward_range is not None:
        low, high = reward_range
        mean = groups.mean(dim=1)
        keep &= (low < mean) & (mean < high)
    return keep


def whiten(values: Tensor, total: float | None = None, total_sq: float | None = None, count: int | None = None,
           eps: float = 1e-8) -> Tensor:
    """(values - mean) / std over the batch; ``total``, ``total_sq`` and ``count`` are the batch's sums over every
    rank (default: this tensor's), so each rank's share is whitened with the whole batch's statistics."""
    values = values.double()
    total = values.sum().item() if total is None else total
    total_sq = values.square().sum().item() if total_sq is None else total_sq
    count = values.numel() if count is None else count
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0) * count / max(count - 1, 1)  # unbiased, as torch.std
    return ((values - mean) / (var ** 0.5 + eps)).float()
