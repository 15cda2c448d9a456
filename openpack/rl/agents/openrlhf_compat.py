"""The names an OpenRLHF agent file imports, for running such a file where openrlhf is not installed.

OpenRLHF's documented agent file (``--agent_func_path``) imports ``AgentInstanceBase`` and
``MultiTurnAgentExecutor`` from ``openrlhf.utils.agent`` and defines ``AgentExecutor``, a
``MultiTurnAgentExecutor`` over its ``AgentInstance`` class. While openpack loads such a file without openrlhf
installed, ``openrlhf.utils.agent`` resolves to this module (``rl/openrlhf_shim``): the classes only
have to exist and carry the instance class; openpack runs the episode itself (``environment.OpenRLHFEnvironment``).
With openrlhf installed, the real module is imported and openpack reads the same attributes from it.
"""

from __future__ import annotations


class AgentInstanceBase:
    """One episode's environment: ``async reset(states)`` (optional) and ``async step(states)``."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    async def step(self, states: dict, **kwargs):
        raise NotImplementedError("an AgentInstance defines async step(states)")


class AgentExecutorBase:
    """OpenRLHF runs its episodes through an executor's ``execute``; openpack reads only the instance class."""


class MultiTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, agent_instance_cls):
        self.agent_instance_cls = agent_instance_cls
