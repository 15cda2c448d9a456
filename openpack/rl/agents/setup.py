"""What a run's agent flags (``config/rl.AgentConfig``) become: the environment factory, the episode limits
and the failure bound, with the defaults the flags leave unset (``None``) resolved here."""

from __future__ import annotations

from openpack.rl.agents.runner import Limits

MAX_TURNS = 8
ENV_TIMEOUT_S = 60.0
MAX_FAILURE_FRACTION = 0.25
CONCURRENCY = 64


def episode_budget(cfg) -> int:
    """The most tokens one sequence of the run can have: a prompt and its completion (at most --max_len), or a
    whole episode."""
    single = cfg.data.prompt_max_len + cfg.rollout.generate_max_len
    if cfg.rollout.max_len is not None:
        single = min(single, cfg.rollout.max_len)
    agent_cfg = getattr(cfg, "agent", None)
    if agent_cfg is None or not agent_cfg.enabled:
        return single
    return agent_cfg.max_episode_tokens or single


def episode_limits(cfg) -> Limits:
    agent_cfg = cfg.agent
    return Limits(agent_cfg.max_turns or MAX_TURNS, episode_budget(cfg), cfg.rollout.generate_max_len,
                  agent_cfg.env_timeout or ENV_TIMEOUT_S)


def max_failure_fraction(agent_cfg) -> float:
    fraction = agent_cfg.max_env_failure_fraction
    return MAX_FAILURE_FRACTION if fraction is None else fraction


def concurrency(agent_cfg) -> int:
    return agent_cfg.agent_concurrency or CONCURRENCY


def agent_environment(agent_cfg, reward_fn: str | None, label_key: str | None):
    """(``make_env``, tool schemas or None) of the run's --env_file, --agent_func_path or --tools (the tool loop
    scoring the final answer with ``reward_fn``, else exact match with the ``label_key`` column)."""
    from openpack.rl.agents.environment import load_env_file

    if agent_cfg.env_file:
        return load_env_file(agent_cfg.env_file, "--env_file"), None
    if agent_cfg.agent_func_path:
        return load_env_file(agent_cfg.agent_func_path, "--agent_func_path"), None
    from openpack.rl.agents.tools import ToolEnvironment, answer_scorer, load_tools, tool_schemas

    tools = load_tools(agent_cfg.tools)
    score = answer_scorer(reward_fn, label_key)
    return (lambda: ToolEnvironment(tools, score)), tool_schemas(tools)
