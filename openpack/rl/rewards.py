"""Where an RL step's rewards come from: a rule function, a remote reward model over HTTP, reward models, or the
built-in task's exact match; asked once per rollout batch on rank 0 and shared (``shared_rewards``), then
shaped (``shaped_rewards``: DAPO's overlong penalty, ProRL's stop-properly penalty, clipping).

Every source is one callable, ``reward(prompts, completions, rows) -> one float per completion``, called on
a whole rollout batch (``rows`` are the prompts' dataset rows, for labels and other columns). ``checked``
wraps any source so that a reward that raises, returns NaN or infinity, or returns the wrong number of
values stops the run with a message naming the source, the batch and what came back (the count, or the bad
value and its index), not a traceback from the trainer; ``--reward_timeout`` bounds one call of a function or
a server.

* ``--reward_fn path.py:function``: a Python function in a file, imported once.
* ``--remote_rm_url http://host:port/path``: OpenRLHF's protocol, a JSON POST
  ``{"query": [prompt + completion, ...], "prompts": [...], "labels": [...]}`` answered with
  ``{"rewards": [...]}``; each request has a timeout, failures are retried a bounded number of times with
  a growing pause, and a server that is down or hangs ends the run with one line naming the URL; an error
  status or a body that is not that JSON ends it quoting the status and the body's first bytes.
* ``--remote_rm_url file.py``: OpenRLHF's reward file, called as OpenRLHF 0.11 calls it, once per completion:
  ``reward_func([query], [prompt], [label])``, the query being the prompt and the completion (its special tokens
  kept, as OpenRLHF decodes), the prompt as the model saw it (templates applied), the label the ``--label_key``
  column ("" without one); it returns ``{"rewards": ..., "scores": ..., "extra_logs": ...}`` or the rewards alone
  (a tensor, a list or a number). As in OpenRLHF, ``scores`` (else the rewards) is what ``--dynamic_filtering``
  tests, and ``extra_logs`` (one number per query under each name) is logged: their means over the batch trained
  on are ``reward/score`` and ``reward/extra/<name>`` in metrics.jsonl (``RewardAnswer``). The file is loaded and
  its signature checked before the run starts (``load_openrlhf_reward``).
* ``--reward_pretrain DIR [DIR ...]``: reward models saved by ``openpack train_rm`` score the token ids of
  prompt + completion, normalised as their config says; several are summed with ``--reward_weights`` or
  combined by ``--reward_fn`` (called with ``rm_scores=[[...] per model]``).
* the built-in task: 1.0 when the completion is the right sum in the bare form, else 0.0 (what the DPO and
  RM demos prefer), read from the row's ``response``.
* none, with ``--teacher_pretrain`` and none of the above (``DistillationOnly``): on-policy distillation alone,
  every reward 0, the teacher's per-token term the whole advantage (``rl/experience.py``).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from openpack.core.advantages import clip_rewards, overlong_penalty, stop_properly_penalty
from openpack.data.loading import DataError
from openpack.data.prompts import Prompt
from openpack.distributed.process import DistInfo, broadcast_object
from openpack.rl.episodes import Rollouts
from openpack.rl.settings import RLSettings

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]


class RewardError(RuntimeError):
    """A reward source failed or answered nonsense; the message names the source, the batch and the fix."""


@dataclass
class RewardAnswer:
    """A reward source's answer for a batch: one reward per completion and, from OpenRLHF's reward files, what
    they report beside it."""

    rewards: list[float]
    scores: list[float] | None = None  # OpenRLHF's ``scores``: what --dynamic_filtering tests (None: the rewards)
    extra_logs: list[dict[str, float]] = field(default_factory=list)  # per completion: its ``extra_logs``


REWARD = "reward"  # the source name of the reward a run trains on, whatever gives it


def reward_model_source(index: int) -> str:
    """The source name of --reward_pretrain model ``index`` (flag order), scored alone next to the combined reward."""
    return f"reward_model_{index}"


def source_names(rl_cfg) -> list[str]:
    """The reward sources a single-turn evaluation reports (``by_source``'s keys): the run's reward, and each reward
    model alone where several are summed or a --reward_fn combines them."""
    models = rl_cfg.reward_pretrain or []
    if len(models) > 1 or models and rl_cfg.reward_fn:
        return [REWARD, *map(reward_model_source, range(len(models)))]
    return [REWARD]


def load_reward_fn(spec: str, keywords: tuple[str, ...] = ()) -> RewardFn:
    """``path.py:function`` -> the function, checked to take (prompts, completions, rows) and the ``keywords``
    openpack passes it (``rm_scores`` where it combines reward models). A bad spec, file, name or signature is a
    RewardError naming --reward_fn, the file and the fix; the driver asks before the run starts
    (``config.rl_checks.check_reward_files``)."""
    flag = f"--reward_fn {spec}"
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise RewardError(f"{flag}: write it as path/to/file.py:function_name")
    file = Path(path).expanduser()
    if not file.is_file():
        raise RewardError(f"{flag}: no file {file}; give the path of the Python file that defines {name}")
    module_spec = importlib.util.spec_from_file_location(f"openpack_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file: any error is theirs to see, with where it came from
        raise RewardError(f"{flag}: importing {file} failed: {type(err).__name__}: {err}; fix the file (it is "
                          "imported where the run starts)") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise RewardError(f"{flag}: {file} has no function {name!r} (it defines {', '.join(defined) or 'none'}); "
                          f"name one after the colon, or define {name}(prompts, completions, rows)")
    call = f"{name}(prompts, completions, rows{''.join(f', {k}=...' for k in keywords)})"
    try:
        inspect.signature(fn).bind(["prompt"], ["completion"], [{}], **{k: [[0.0]] for k in keywords})
    except TypeError as err:
        raise RewardError(f"{flag}: {name}{inspect.signature(fn)} cannot be called as {call}, as openpack calls "
                          f"it ({err}); give it those parameters") from err
    except ValueError:  # a builtin or C function without a signature: called as it is
        pass
    fn.reward_name = flag
    return fn


def is_reward_file(url: str | None) -> bool:
    """``--remote_rm_url`` names OpenRLHF's Python reward file rather than a server (OpenRLHF tells them apart
    the same way: by the ``.py`` ending)."""
    return bool(url) and url.endswith(".py")


def load_openrlhf_reward(path: str) -> Callable:
    """The ``reward_func`` of OpenRLHF's reward file ``path`` (``--remote_rm_url file.py``), imported with the
    ``openrlhf`` names it may import (``rl/openrlhf_shim``) and checked: it exists and takes (queries, prompts,
    labels). Anything else is a RewardError naming the file and the fix; the driver asks before the run starts."""
    from openpack.rl.openrlhf_shim import openrlhf_names

    flag, file = f"--remote_rm_url {path}", Path(path).expanduser()
    if not file.is_file():
        raise RewardError(f"{flag}: no such file; give OpenRLHF's reward file (a .py defining reward_func(queries, "
                          "prompts, labels, **kwargs)) or a reward server's http:// URL")
    module_spec = importlib.util.spec_from_file_location(f"openpack_reward_func_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        with openrlhf_names():
            module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file: any error is theirs to see, with where it came from
        raise RewardError(f"{flag}: importing it failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        raise RewardError(f"{flag}: the file defines no function reward_func; OpenRLHF's reward file defines "
                          "reward_func(queries, prompts, labels, **kwargs)")
    try:
        inspect.signature(fn).bind(["query"], ["prompt"], ["label"])
    except TypeError as err:
        raise RewardError(f"{flag}: reward_func{inspect.signature(fn)} cannot be called as reward_func(queries, "
                          f"prompts, labels), as OpenRLHF calls it ({err}); give it those three parameters "
                          "(and **kwargs)") from err
    except ValueError:  # a builtin or C function without a signature: called as it is
        pass
    return fn


def openrlhf_reward(path: str, label_key: str | None) -> RewardFn:
    """OpenRLHF's ``reward_func`` of ``path`` as a reward source (see the module docstring for how it is called);
    an answer that is not rewards is a RewardError naming the file and what came back.

    The completions come with their special tokens (``keeps_special_tokens``), so a query is prompt + completion
    as OpenRLHF decodes its ids (``skip_special_tokens=False``): ``"sort: cab\n" + "abc<eos>"``. OpenRLHF encodes
    its prompt text without adding a bos, so its query starts with the prompt, which its example files cut off
    (``query[len(prompt):]``); openpack's prompt ids may hold an added bos, hence the text, not the ids."""
    fn = load_openrlhf_reward(path)

    def reward(prompts, completions, rows) -> RewardAnswer:
        labels = [row.get(label_key, "") if label_key else "" for row in rows]
        answers = [_openrlhf_answer(fn([prompt + completion], [prompt], [label]), path)
                   for prompt, completion, label in zip(prompts, completions, labels)]
        rewards = [r for r, _, _ in answers]
        scored = any(s is not None for _, s, _ in answers)  # a query without scores is scored by its reward
        return RewardAnswer(rewards, [r if s is None else s for r, s, _ in answers] if scored else None,
                            [logs for _, _, logs in answers])

    reward.reward_name = f"--remote_rm_url {path} (reward_func)"
    reward.keeps_special_tokens = True
    return reward


def _openrlhf_answer(answer, path: str) -> tuple[float, float | None, dict[str, float]]:
    """One query's (reward, score or None, extra_logs) from what ``reward_func`` returned: a dict of ``rewards``,
    ``scores`` and ``extra_logs``, or the rewards alone. Each is one number: a float, or a tensor or list whose
    first element is taken (as OpenRLHF takes ``extra_logs``' values)."""
    rewards = answer.get("rewards") if isinstance(answer, dict) else answer
    if hasattr(rewards, "tolist"):  # a tensor or an array, of one value or a 0-d one
        rewards = rewards.tolist()
    if isinstance(rewards, (int, float)) and not isinstance(rewards, bool):
        rewards = [rewards]
    if not isinstance(rewards, list) or len(rewards) != 1:
        what = f"a dict without 'rewards' (keys {list(answer)})" if isinstance(answer, dict) and \
            "rewards" not in answer else f"{type(answer).__name__} {str(answer)[:80]!r}"
        raise RewardError(f"--remote_rm_url {path}: reward_func returned {what} for one query; return "
                          "{'rewards': tensor([r]), 'scores': ..., 'extra_logs': {...}} or the rewards alone, "
                          "one per query")
    if not isinstance(answer, dict):
        return rewards[0], None, {}
    score = answer.get("scores")
    logs = answer.get("extra_logs") or {}
    if not isinstance(logs, dict):
        raise RewardError(f"--remote_rm_url {path}: reward_func returned extra_logs {str(logs)[:80]!r}; return a "
                          "dict of name -> one number per query")
    return (rewards[0], None if score is None else _one_number(score, "scores", path),
            {str(name): _one_number(value, f"extra_logs[{name!r}]", path) for name, value in logs.items()})


def _one_number(value, what: str, path: str) -> float:
    """A reward file's ``scores`` or ``extra_logs`` value for one query as a float (a tensor's or a list's first
    element); anything else is a RewardError naming the file."""
    if hasattr(value, "flatten"):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise RewardError(f"--remote_rm_url {path}: reward_func returned {what} {str(value)[:80]!r} for one query; "
                      "return one finite number per query (a float, or a one-element tensor)")


def remote_reward(url: str, timeout_s: float = 60.0, retries: int = 3, pause_s: float = 1.0,
                  label_key: str = "label") -> RewardFn:
    """A reward source that POSTs each batch to ``url`` (OpenRLHF's JSON protocol; see the module docstring).

    A refused connection, a timeout, HTTP 429 or 5xx is retried; any other answer is final: HTTP 4xx (the same
    request fails again) and a body that is not ``{"rewards": [...]}`` end the run with the status or the body's
    first bytes."""

    def reward(prompts, completions, rows):
        payload = {"query": [p + c for p, c in zip(prompts, completions)], "prompts": list(prompts),
                   "labels": [row.get(label_key) for row in rows]}
        request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        failures, hint = [], "check that the reward server is up and reachable"
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    return _rewards_in(url, answer.read())
            except urllib.error.HTTPError as err:  # before URLError, its base: the server answered
                status = f"HTTP {err.code} {err.reason}, body {_first_bytes(_body(err))}"
                if err.code < 500 and err.code != 429:
                    raise RewardError(f"--remote_rm_url {url}: answered {status}; fix the request the server "
                                      "refuses (see its log) or the URL") from err
                failures.append(status)
                hint = "the server failed on this batch: see its log"
            except (urllib.error.URLError, TimeoutError, OSError) as err:
                failures.append(f"{type(err).__name__}: {getattr(err, 'reason', err)}")
            if attempt < retries:
                time.sleep(pause_s * 2 ** attempt)
        raise RewardError(f"--remote_rm_url {url}: no answer after {retries + 1} tries ({failures[-1]}; timeout "
                          f"{timeout_s:g} s each); {hint}")

    reward.reward_name = f"--remote_rm_url {url}"
    return reward


def _rewards_in(url: str, raw: bytes):
    """The ``rewards`` of a server's answer; anything else is a RewardError quoting the body's first bytes."""
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise RewardError(f"--remote_rm_url {url}: the answer is not JSON ({err}): {_first_bytes(raw)}; answer "
                          '{"rewards": [one number per query]}') from err
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
        raise RewardError(f"--remote_rm_url {url}: the answer has no 'rewards' list: {_first_bytes(raw)}; answer "
                          '{"rewards": [one number per query]}')
    return body["rewards"]


def _body(err: urllib.error.HTTPError) -> bytes:
    try:
        return err.read()
    except OSError:
        return b""


def _first_bytes(raw: bytes, limit: int = 200) -> str:
    """A body as one quoted line: its first ``limit`` bytes, and how many there were in all."""
    text = repr(raw[:limit].decode("utf-8", errors="replace"))
    return text if len(raw) <= limit else f"{text}... ({len(raw)} bytes)"


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

    def by_source(prompts, completions, rows, sequences) -> dict[str, list[float]]:
        scores = [[float(v) for v in scorer.score(sequences)] for scorer in scorers]
        if combine is not None:
            combined = combine(prompts, completions, rows, rm_scores=scores)
        else:
            combined = [sum(w * s[i] for w, s in zip(weights, scores)) for i in range(len(sequences))]
        if len(scorers) == 1 and combine is None:
            return {REWARD: combined}
        return {REWARD: combined, **{reward_model_source(i): s for i, s in enumerate(scores)}}

    def reward(prompts, completions, rows, sequences):
        return by_source(prompts, completions, rows, sequences)[REWARD]

    reward.reward_name = f"--reward_pretrain {' '.join(names)}" + (
        f" combined by {getattr(combine, 'reward_name', 'a function')}" if combine is not None else "")
    reward.takes_sequences = True
    reward.by_source = by_source
    return reward


def checked(source: RewardFn, timeout_s: float | None = None) -> Callable[..., list[float]]:
    """``source`` called on a batch, its answer checked: one finite number per completion, else a RewardError.
    A source marked ``takes_sequences`` (reward models) also gets each prompt + completion's token ids.
    ``timeout_s`` (``--reward_timeout``) bounds one call; see ``within``."""
    name = getattr(source, "reward_name", getattr(source, "__name__", repr(source)))
    extra = ("sequences",) if getattr(source, "takes_sequences", False) else ()

    def answer(call, prompts, completions, rows, batch, sequences):
        try:
            return within(timeout_s, lambda: call(prompts, completions, rows, *(sequences for _ in extra)),
                          f"{name} gave no answer within --reward_timeout {timeout_s or 0:g} s on {batch} "
                          f"({len(completions)} completions); make it faster or raise --reward_timeout")
        except RewardError:
            raise
        except Exception as err:  # a user's reward function: name it and the batch, keep the cause
            raise RewardError(f"{name} raised {type(err).__name__}: {err} (on {batch}, {len(completions)} "
                              "completions)") from err

    def scored(prompts, completions, rows, batch: str = "this batch", sequences=None) -> RewardAnswer:
        """The rewards and, from a source that reports them (OpenRLHF's reward files), the scores and logs."""
        values = answer(source, prompts, completions, rows, batch, sequences)
        if isinstance(values, RewardAnswer):  # built by openpack's own adapter: one score and log per completion
            return RewardAnswer(numbers_of(name, values.rewards, len(completions), batch), values.scores,
                                values.extra_logs)
        return RewardAnswer(numbers_of(name, values, len(completions), batch))

    def reward(prompts, completions, rows, batch: str = "this batch", sequences=None) -> list[float]:
        return scored(prompts, completions, rows, batch, sequences).rewards

    def by_source(prompts, completions, rows, batch: str = "this batch", sequences=None) -> dict[str, list[float]]:
        """Each source's rewards (``source_names``): the run's reward and, for several reward models, each alone."""
        if not hasattr(source, "by_source"):
            return {REWARD: reward(prompts, completions, rows, batch, sequences)}
        parts = answer(source.by_source, prompts, completions, rows, batch, sequences)
        return {part: numbers_of(name, values, len(completions), batch) for part, values in parts.items()}

    reward.reward_name = name
    reward.by_source = by_source
    reward.scored = scored
    reward.keeps_special_tokens = getattr(source, "keeps_special_tokens", False)
    return reward


def numbers_of(name: str, values, count: int, batch: str) -> list[float]:
    """``values`` as ``count`` finite floats, else a RewardError naming source ``name``, the batch and the value."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise RewardError(f"{name} returned {str(values)[:120]!r} on {batch}: expected a list of one number "
                          "per completion")
    values = list(values)  # a generator, a tensor or an array as well
    if len(values) != count:
        raise RewardError(f"{name} returned {len(values)} rewards for {count} completions on {batch}")
    numbers = []
    for i, value in enumerate(values):
        try:
            if isinstance(value, (str, bytes)):  # float("0.5") would pass: a text is a bug in the source
                raise TypeError
            numbers.append(float(value))
        except (TypeError, ValueError) as err:
            raise RewardError(f"{name} returned {str(value)[:60]!r} (a {type(value).__name__}) for completion "
                              f"{i} of {batch}: every reward must be a number") from err
    bad = [i for i, v in enumerate(numbers) if not math.isfinite(v)]
    if bad:
        raise RewardError(f"{name} returned {numbers[bad[0]]} for completion {bad[0]} of {batch} "
                          f"({len(bad)} not finite): every reward must be a finite number")
    return numbers


def within(timeout_s: float | None, call: Callable, message: str):
    """``call()``, or a RewardError with ``message`` when it has not returned after ``timeout_s`` seconds.

    The call runs in a daemon thread, the only way to stop waiting for a Python function that hangs; the thread
    is left behind, and the run ends. ``None`` calls it here, in this thread (``--reward_timeout 0``: for a
    function whose own timeouts use ``signal.alarm``, which works only in the main thread).
    """
    if timeout_s is None:
        return call()
    result = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as err:  # handed to the caller's thread as it was raised
            result["error"] = err

    thread = threading.Thread(target=run, name="openpack-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardError(message)
    if "error" in result:
        raise result["error"]
    return result["value"]


def reward_source(rl_cfg, data_cfg, is_demo: bool, scorers: list | None = None):
    """--reward_pretrain (``scorers``: one per model; with --reward_fn combining them), --reward_fn,
    --remote_rm_url (a server, or OpenRLHF's reward file), exact match on --label_key, or (demo) the task's exact
    match; checked."""
    if rl_cfg.reward_pretrain:
        combine = load_reward_fn(rl_cfg.reward_fn, ("rm_scores",)) if rl_cfg.reward_fn else None
        return checked(reward_models(scorers, rl_cfg.reward_pretrain, rl_cfg.reward_weights, combine))
    timeout = rl_cfg.reward_timeout or None  # reward models are not cut off: their speed is the trainer's
    if rl_cfg.reward_fn:
        return checked(load_reward_fn(rl_cfg.reward_fn), timeout)
    if is_reward_file(rl_cfg.remote_rm_url):
        return checked(openrlhf_reward(rl_cfg.remote_rm_url, data_cfg.label_key), timeout)
    if rl_cfg.remote_rm_url:
        return checked(remote_reward(rl_cfg.remote_rm_url, rl_cfg.remote_rm_timeout, label_key=data_cfg.label_key
                                     or "label"), timeout)
    if data_cfg.label_key:
        return checked(exact_match(data_cfg.label_key))
    if is_demo:
        return checked(exact_match_reward)
    raise DataError("no reward: give --reward_fn path.py:function, --remote_rm_url URL, or --label_key COLUMN "
                    "(exact match of the completion to that column), or --teacher_pretrain PATH (on-policy "
                    "distillation alone)")


def names_task_reward(rl_cfg, data_cfg) -> bool:
    """Whether the flags name a reward source (``reward_source``'s, the built-in demo's aside)."""
    return bool(rl_cfg.reward_pretrain or rl_cfg.reward_fn or rl_cfg.remote_rm_url or data_cfg.label_key)


def distillation_only(rl_cfg, data_cfg, agent_cfg) -> bool:
    """--teacher_pretrain with no reward flag and no environment: the teacher's signal alone (also in the demo,
    whose exact-match reward then stays off)."""
    return bool(rl_cfg.teacher_pretrain) and not names_task_reward(rl_cfg, data_cfg) and not agent_cfg.enabled


class RolloutRewards(Protocol):
    """A rollout batch's raw rewards, one per completion (and a reward file's scores and logs), on every rank
    (``prompts``: one per group of n)."""

    name: str  # said when a reward gives nothing to learn from

    def __call__(self, prompts: list[Prompt], rollouts: Rollouts, dist: DistInfo, where: str) -> RewardAnswer:
        ...


class SourceRewards:
    """A reward source's answer for single completions: asked on rank 0 with the texts of each prompt and
    completion and the prompt's row (reward models: also the token ids of prompt + completion), then shared."""

    def __init__(self, source, tokenizer, n: int):
        self.source, self.tokenizer, self.n = source, tokenizer, n
        self.name = getattr(source, "reward_name", "the reward")

    def __call__(self, prompts: list[Prompt], rollouts: Rollouts, dist: DistInfo, where: str) -> RewardAnswer:
        return shared_rewards(self.source.scored, self._texts(prompts, rollouts), dist, where,
                              self._sequences(rollouts))

    def by_source(self, prompts: list[Prompt], rollouts: Rollouts, dist: DistInfo, where: str) -> dict[str, list[float]]:
        """Each source's rewards (``source_names``) of ``rollouts``, ``self.n`` a prompt, on every rank."""
        return shared_rewards(self.source.by_source, self._texts(prompts, rollouts), dist, where,
                              self._sequences(rollouts))

    def _texts(self, prompts: list[Prompt], rollouts: Rollouts) -> tuple[list[str], list[str], list[dict]]:
        special = getattr(self.source, "keeps_special_tokens", False)  # OpenRLHF's reward files: its decoding
        return ([p.text for p in prompts for _ in range(self.n)],
                self.tokenizer.batch_decode(rollouts.completion_tokens, skip_special_tokens=not special),
                [p.row for p in prompts for _ in range(self.n)])

    @staticmethod
    def _sequences(rollouts: Rollouts) -> list[list[int]]:
        return [p + c for p, c in zip(rollouts.prompt_tokens, rollouts.completion_tokens)]


class DistillationOnly:
    """No task reward (on-policy distillation alone): every completion's reward is 0, so every estimator's
    advantage is 0 and the teacher's per-token term is the whole signal."""

    name = "no reward (distillation alone)"

    def __call__(self, prompts: list[Prompt], rollouts: Rollouts, dist: DistInfo, where: str) -> RewardAnswer:
        return RewardAnswer([0.0] * rollouts.size)


class EpisodeRewards:
    """Multi-turn episodes' rewards: their environments', summed over each episode's turns (``rl/agents``),
    already on every rank."""

    name = "the environment"

    def __call__(self, prompts: list[Prompt], rollouts: Rollouts, dist: DistInfo, where: str) -> RewardAnswer:
        return RewardAnswer(rollouts.env_rewards)


def shared_rewards(reward, texts: tuple[list[str], list[str], list[dict]], dist: DistInfo, where: str,
                   sequences: list[list[int]] | None = None) -> RewardAnswer | dict[str, list[float]]:
    """Rank 0 asks the reward source (once per batch); every rank gets the answer (the rewards, or ``by_source``'s
    rewards of each source), or raises rank 0's error, so no rank is left waiting in a collective when a reward
    fails."""
    answer = None
    if dist.is_main:
        try:
            answer = (reward(*texts, batch=where, sequences=sequences), None)
        except RewardError as err:
            answer = (None, str(err))
    values, error = broadcast_object(answer)
    if error is not None:
        raise RewardError(error)
    return values


def shaped_rewards(raw: list[float], response_lengths: list[int], finished: list[bool],
                   settings: RLSettings) -> tuple[list[float], dict]:
    """The source's rewards plus DAPO's overlong penalty, those of completions cut at their budget (not
    ``finished``) penalised as ProRL does (--stop_properly_penalty_coef), then clipped to --reward_clip_range, in
    OpenRLHF 0.11's order; with metrics."""
    rewards, metrics = torch.tensor(raw, dtype=torch.float32), {}
    if settings.overlong_buffer_len:
        penalty = overlong_penalty(torch.tensor(response_lengths), settings.generate_max_len,
                                   settings.overlong_buffer_len, settings.overlong_penalty_factor)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    if settings.stop_properly_penalty_coef is not None:
        rewards = stop_properly_penalty(rewards, ~torch.tensor(finished, dtype=torch.bool),
                                        settings.stop_properly_penalty_coef)
    if settings.reward_clip_range is not None:
        metrics["reward/source"] = sum(raw) / len(raw)
        rewards = clip_rewards(rewards, settings.reward_clip_range)
    return rewards.tolist(), metrics
