"""Multi-turn agent episodes (issue 27): environments, tools, token-in-token-out episodes.

Not wired into ``train_grpo``/``train_ppo`` yet: the episode runner, the environment protocols (native and
OpenRLHF's) and the tool loop are here with their tests; training on episodes is the next step (docs/agents.md).
"""
