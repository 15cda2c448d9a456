"""Environments an episode runs against: openpack's native protocol, and OpenRLHF's agent files unchanged.

Native (``--env_file``): a class with ``async reset(sample)`` and ``async step(action)``, one instance per
episode, built with no arguments::

    class Calculator:
        async def reset(self, sample):              # sample: the dataset row (its "prompt", its "label", ...)
            self.answer = sample["label"]
            return sample["prompt"]                 # the first observation: text, or chat messages
        async def step(self, action):               # action: the text the model sampled this turn
            done = "=" in action
            return {"observation": "" if done else "Go on.", "reward": float(done and self.answer in action),
                    "done": done}

``step`` returns a ``StepResult``, a dict of its fields, or a gym-style ``(observation, reward, done, info)``.
An observation that is text is appended as its own ids; chat messages go through the tokenizer's chat template
(``agents.chat``).

OpenRLHF (``--agent_func_path``): a file defining ``AgentExecutor`` (a ``MultiTurnAgentExecutor`` over its
instance class) or ``AgentInstance``, with ``async reset(states)`` / ``async step(states)``, where ``states``
holds ``observation`` and ``label`` (reset) or ``observation_text``, ``action_text``, ``label`` (step), and step
returns ``rewards`` (a tensor or float), ``environment_feedback``, ``done``, and optionally ``scores`` and
``extra_logs``. ``reset``'s observation is the prompt as OpenRLHF hands it over: the text the model sees, chat
messages rendered by the chat template (with its generation prompt). Its feedback is raw text with the turn markup
in it, appended as ids as OpenRLHF appends it; the episode's reward is the sum of its turns' ``rewards``. The file
runs without openrlhf installed: its ``from openrlhf.utils.agent import ...`` gets ``agents.openrlhf_compat``
while openpack loads it (``rl/openrlhf_shim``).
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path


class EnvFileError(ValueError):
    """An environment file that cannot be loaded or used; the message names the file, the flag and the fix."""


@dataclass
class StepResult:
    observation: str | list[dict] | None  # None (or "") when done: nothing is appended
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def step_result(value, where: str) -> StepResult:
    """A native ``step``'s return value as a StepResult; ``where`` names the class for the error."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, dict):
        unknown = set(value) - {"observation", "reward", "done", "metrics"}
        if unknown:
            raise EnvFileError(f"{where}.step returned unknown keys {sorted(unknown)}; it returns observation, "
                               "reward, done and optionally metrics")
        result = StepResult(value.get("observation"), value.get("reward", 0.0), value.get("done", False),
                            dict(value.get("metrics") or {}))
    elif isinstance(value, tuple) and len(value) == 4:
        observation, reward, done, info = value
        result = StepResult(observation, reward, done, dict(info or {}))
    else:
        raise EnvFileError(f"{where}.step returned {type(value).__name__}; it returns a StepResult, a dict of "
                           "observation/reward/done/metrics, or (observation, reward, done, info)")
    return StepResult(result.observation, as_float(result.reward, f"{where}.step's reward"), bool(result.done),
                      {k: as_float(v, f"{where}.step's metric {k!r}") for k, v in result.metrics.items()})


def as_float(value, what: str) -> float:
    """A Python number, or a one-element tensor/array (OpenRLHF's rewards are tensors), as a float."""
    item = getattr(value, "item", None)
    try:
        return float(item() if item is not None else value)
    except (TypeError, ValueError) as err:
        raise EnvFileError(f"{what} is {type(value).__name__} {value!r}, not a number") from err


class NativeEnvironment:
    """One episode of a native environment class."""

    def __init__(self, cls):
        self.name = cls.__name__
        self.instance = cls()

    async def reset(self, sample: dict):
        return await self.instance.reset(sample)

    async def step(self, action: str) -> StepResult:
        return step_result(await self.instance.step(action), self.name)


class OpenRLHFEnvironment:
    """One episode of an OpenRLHF ``AgentInstance``: its states dicts, its summed rewards, its text feedback."""

    def __init__(self, cls):
        self.name = cls.__name__
        self.instance = cls()
        self.text = ""
        self.label = ""

    async def reset(self, sample: dict) -> str:
        self.label = sample.get("label", "")
        prompt = sample["prompt"]  # the rendered prompt text (``openrlhf_factory``)
        states = await self.instance.reset({"observation": prompt, "label": self.label})
        observation = states.get("observation", prompt) if isinstance(states, dict) else prompt
        if not isinstance(observation, str):
            raise EnvFileError(f"{self.name}.reset returned observation of type {type(observation).__name__}; "
                               "OpenRLHF's protocol returns {'observation': text}")
        self.text = observation
        return observation

    async def step(self, action: str) -> StepResult:
        result = await self.instance.step({"observation_text": self.text, "action_text": action,
                                           "label": self.label, "sampling_params": None})
        if not isinstance(result, dict) or not {"rewards", "environment_feedback", "done"} <= set(result):
            raise EnvFileError(f"{self.name}.step must return a dict with rewards, environment_feedback and done "
                               f"(OpenRLHF's protocol); got {type(result).__name__}")
        feedback = result["environment_feedback"] or ""
        self.text += action + feedback
        metrics = {k: as_float(v, f"{self.name}.step's extra_logs[{k!r}]")
                   for k, v in (result.get("extra_logs") or {}).items()}
        if "scores" in result:
            metrics["score"] = as_float(result["scores"], f"{self.name}.step's scores")
        return StepResult(feedback, as_float(result["rewards"], f"{self.name}.step's rewards"),
                          bool(result["done"]), metrics)


def openrlhf_factory(cls):
    """One-episode environments of an OpenRLHF ``AgentInstance`` class. ``resets_on_rendered_prompt``: OpenRLHF
    hands ``reset`` the prompt as the model sees it (chat messages rendered by the chat template with its
    generation prompt, or the text filled into the input template), not the dataset's column; the caller builds
    the sample so (``rl/worker.agent_generator``)."""
    def factory():
        return OpenRLHFEnvironment(cls)

    factory.resets_on_rendered_prompt = True
    return factory


def load_env_file(path: str, flag: str = "--env_file"):
    """The environment class of ``path``, as a factory of one-episode environments (``factory()``)."""
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise EnvFileError(f"{flag} {path}: not a Python file")
    module = _exec_module(file, flag)
    executor = getattr(module, "AgentExecutor", None)
    if executor is not None:
        try:
            return openrlhf_factory(executor().agent_instance_cls)
        except Exception as err:  # noqa: BLE001 - the user's constructor; say which
            raise EnvFileError(f"{flag} {path}: AgentExecutor() failed: {type(err).__name__}: {err}") from err
    if inspect.isclass(getattr(module, "AgentInstance", None)):
        return openrlhf_factory(module.AgentInstance)
    candidates = [obj for obj in vars(module).values() if inspect.isclass(obj) and obj.__module__ == module.__name__
                  and all(inspect.iscoroutinefunction(getattr(obj, m, None)) for m in ("reset", "step"))]
    if len(candidates) != 1:
        found = ", ".join(c.__name__ for c in candidates) or "none"
        raise EnvFileError(f"{flag} {path}: define exactly one class with async reset(sample) and async "
                           f"step(action) (found: {found}), or OpenRLHF's AgentExecutor/AgentInstance")
    (cls,) = candidates
    return lambda: NativeEnvironment(cls)


def _exec_module(file: Path, flag: str):
    from openpack.rl.openrlhf_shim import openrlhf_names

    name = f"openpack_env_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    try:
        with openrlhf_names():  # without openrlhf installed, its imports resolve to openpack's stand-ins
            spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file; one line naming it
        raise EnvFileError(f"{flag} {file}: importing it failed: {type(err).__name__}: {err}") from err
    return module
