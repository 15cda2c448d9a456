"""Tools from plain Python functions, shown through the chat template and called from Hermes-style tool calls.

``--tools FILE``: every public function the file defines, with type hints and a Google-style docstring, becomes a
tool; its JSON schema is transformers' ``get_json_schema``, given to ``apply_chat_template(tools=...)``. A tool
call is parsed in the Hermes format of Qwen-family templates, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one or more per turn); no other format is parsed. ``ToolEnvironment`` is the built-in
environment: each turn either calls tools (their results come back as ``tool`` messages) or answers, and the
answer is scored (exact match with the row's label unless a scorer is given).
"""

from __future__ import annotations

import inspect
import json
import re

from openpack.rl.agents.environment import EnvFileError, StepResult, _exec_module

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def load_tools(path: str, flag: str = "--tools") -> dict:
    """{name: function} of the public functions ``path`` defines, each with a JSON schema transformers can build."""
    from pathlib import Path

    from transformers.utils import get_json_schema

    module = _exec_module(Path(path), flag)
    tools = {name: fn for name, fn in vars(module).items()
             if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")}
    if not tools:
        raise EnvFileError(f"{flag} {path}: defines no public function to use as a tool")
    for name, fn in tools.items():
        try:
            get_json_schema(fn)
        except Exception as err:  # noqa: BLE001 - transformers says what is missing (a hint, a docstring)
            raise EnvFileError(f"{flag} {path}: {name} cannot be a tool: {err}") from err
    return tools


def tool_schemas(tools: dict) -> list[dict]:
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools.values()]


def parse_tool_calls(text: str) -> list[dict] | None:
    """The Hermes-style calls in ``text``: [{"name", "arguments"}], [] if it has a malformed one, None if none."""
    blocks = _CALL.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        calls.append({"name": call["name"], "arguments": call.get("arguments") or {}})
    return calls


def exact_match(answer: str, sample: dict) -> float:
    return float(answer.strip() == str(sample.get("label", "")).strip())


def answer_scorer(reward_fn: str | None, label_key: str | None):
    """``score(answer, sample)`` of the final answer: ``--reward_fn`` (called as ``fn([prompt], [answer], [row])``),
    else exact match with the row's ``--label_key`` (the sample's ``label``)."""
    if not reward_fn:
        return exact_match
    from openpack.rl.rewards import load_reward_fn

    fn = load_reward_fn(reward_fn)

    def score(answer: str, sample: dict) -> float:
        (value,) = fn([sample["prompt"]], [answer], [sample])
        return float(value)

    return score


class ToolEnvironment:
    """The built-in tool loop: the prompt as a user message; tool calls run, answers scored."""

    def __init__(self, tools: dict, score=exact_match):
        self.tools, self.score = tools, score
        self.sample: dict = {}
        self.calls = self.failures = 0

    async def reset(self, sample: dict) -> list[dict]:
        self.sample = sample
        prompt = sample["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    async def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action)
        if calls is None:  # an answer
            return StepResult(None, self.score(action, self.sample), True, self._metrics())
        messages = []
        for call in calls or [{"name": "", "arguments": {}}]:
            self.calls += 1
            messages.append({"role": "tool", "name": call["name"], "content": await self._call(call)})
        return StepResult(messages, 0.0, False, self._metrics())

    async def _call(self, call: dict) -> str:
        fn = self.tools.get(call["name"])
        if fn is None:
            self.failures += 1
            return json.dumps({"error": f"no tool named {call['name']!r} (a malformed call?)"})
        try:
            result = fn(**call["arguments"])
            if inspect.isawaitable(result):
                result = await result
            return str(result)
        except Exception as err:  # noqa: BLE001 - a failing tool is the model's information, and counted
            self.failures += 1
            return json.dumps({"error": f"{type(err).__name__}: {err}"})

    def _metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "tool_failures": float(self.failures)}

