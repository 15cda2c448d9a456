"""Rewards for online RL: a rule function, a remote reward model over HTTP, or the built-in task's exact match.

Every source is one callable, ``reward(prompts, completions, rows) -> one float per completion``, called on
a whole rollout batch (``rows`` are the prompts' dataset rows, for labels and other columns). ``checked``
wraps any source so that a reward that raises, returns NaN or infinity, or returns the wrong number of
values stops the run with a message naming the source and the batch, not a traceback from the trainer.

* ``--reward_fn path.py:function``: a Python function in a file, imported once.
* ``--remote_rm_url http://host:port/path``: OpenRLHF's protocol, a JSON POST
  ``{"query": [prompt + completion, ...], "prompts": [...], "labels": [...]}`` answered with
  ``{"rewards": [...]}``; each request has a timeout, failures are retried a bounded number of times with
  a growing pause, and a server that is down or hangs ends the run with one line naming the URL.
* ``--reward_pretrain DIR [DIR ...]``: reward models saved by ``openpack train_rm`` score the token ids of
  prompt + completion, normalised as their config says; several are summed with ``--reward_weights`` or
  combined by ``--reward_fn`` (called with ``rm_scores=[[...] per model]``).
* the built-in task: 1.0 when the completion is the right sum in the bare form, else 0.0 (what the DPO and
  RM demos prefer), read from the row's ``response``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]


class RewardError(RuntimeError):
    """A reward source failed or answered nonsense; the message names the source, the batch and the fix."""


def load_reward_fn(spec: str) -> RewardFn:
    """``path.py:function`` -> the function; a bad file, name or object is a RewardError naming --reward_fn."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise RewardError(f"--reward_fn {spec}: write it as path/to/file.py:function_name")
    file = Path(path).expanduser()
    if not file.is_file():
        raise RewardError(f"--reward_fn {spec}: no file {file}")
    module_spec = importlib.util.spec_from_file_location(f"openpack_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file: any error is theirs to see, with where it came from
        raise RewardError(f"--reward_fn {spec}: importing {file} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"--reward_fn {spec}: {file} has no function {name!r}")
    fn.reward_name = f"--reward_fn {spec}"
    return fn


def remote_reward(url: str, timeout_s: float = 60.0, retries: int = 3, pause_s: float = 1.0,
                  label_key: str = "label") -> RewardFn:
    """A reward source that POSTs each batch to ``url`` (OpenRLHF's JSON protocol; see the module docstring)."""

    def reward(prompts, completions, rows):
        payload = {"query": [p + c for p, c in zip(prompts, completions)], "prompts": list(prompts),
                   "labels": [row.get(label_key) for row in rows]}
        request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        failures = []
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    body = json.loads(answer.read())
                if not isinstance(body, dict) or "rewards" not in body:
                    raise RewardError(f"--remote_rm_url {url}: the answer has no 'rewards' list: {str(body)[:200]}")
                return body["rewards"]
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as err:
                failures.append(f"{type(err).__name__}: {getattr(err, 'reason', err)}")
                if attempt < retries:
                    time.sleep(pause_s * 2 ** attempt)
        raise RewardError(f"--remote_rm_url {url}: no answer after {retries + 1} tries ({failures[-1]}; timeout "
                          f"{timeout_s:g} s each); check that the reward server is up and reachable")

    reward.reward_name = f"--remote_rm_url {url}"
    return reward


def exact_match(label_key: str) -> RewardFn:
    """1.0 when the completion, stripped, equals the row's ``label_key`` column, stripped (``--label_key``)."""

    def reward(prompts, completions, rows):
        missing = [i for i, row in enumerate(rows) if not isinstance(row.get(label_key), str)]
        if missing:
            raise RewardError(f"--label_key {label_key}: row {missing[0]} of the batch has no text under "
                              f"'{label_key}' ({len(missing)} rows without one); fix the data or the key")
        return [float(c.strip() == row[label_key].strip()) for c, row in zip(completions, rows)]

    reward.reward_name = f"exact match against --label_key {label_key}"
    return reward


exact_match_reward = exact_match("response")  # the built-in task: the right sum in the bare form
exact_match_reward.reward_name = "the built-in task's exact-match reward"


def reward_models(scorers: list, names: list[str], weights: list[float] | None = None,
                  combine: RewardFn | None = None) -> RewardFn:
    """``--reward_pretrain``: each model scores the token ids of prompt + completion (``scorer.score(sequences)``,
    normalised by its saved config); the scores are summed with ``weights`` (``--reward_weights``), or handed to
    ``combine`` (``--reward_fn``) as its keyword ``rm_scores``, one list per model in flag order."""
    weights = weights or [1.0] * len(scorers)

    def reward(prompts, completions, rows, sequences):
        scores = [[float(v) for v in scorer.score(sequences)] for scorer in scorers]
        if combine is not None:
            return combine(prompts, completions, rows, rm_scores=scores)
        return [sum(w * s[i] for w, s in zip(weights, scores)) for i in range(len(sequences))]

    reward.reward_name = f"--reward_pretrain {' '.join(names)}" + (
        f" combined by {getattr(combine, 'reward_name', 'a function')}" if combine is not None else "")
    reward.takes_sequences = True
    return reward


def checked(source: RewardFn) -> Callable[..., list[float]]:
    """``source`` called on a batch, its answer checked: one finite number per completion, else a RewardError.
    A source marked ``takes_sequences`` (reward models) also gets each prompt + completion's token ids."""
    name = getattr(source, "reward_name", getattr(source, "__name__", repr(source)))
    extra = ("sequences",) if getattr(source, "takes_sequences", False) else ()

    def reward(prompts, completions, rows, batch: str = "this batch", sequences=None) -> list[float]:
        try:
            values = source(prompts, completions, rows, *(sequences for _ in extra))
        except RewardError:
            raise
        except Exception as err:  # a user's reward function: name it and the batch, keep the cause
            raise RewardError(f"{name} raised {type(err).__name__}: {err} (on {batch}, {len(completions)} "
                              "completions)") from err
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            raise RewardError(f"{name} returned {str(values)[:120]!r} on {batch}: expected one number per "
                              "completion") from err
        if len(values) != len(completions):
            raise RewardError(f"{name} returned {len(values)} rewards for {len(completions)} completions on {batch}")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RewardError(f"{name} returned {values[bad[0]]} for completion {bad[0]} of {batch} "
                              f"({len(bad)} not finite): every reward must be a finite number")
        return values

    return reward
