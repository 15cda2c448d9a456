"""The ``openrlhf`` names that OpenRLHF's reward and agent files import, for running them without openrlhf.

A file written for OpenRLHF's ``--reward.remote_url file.py`` or ``--agent_func_path`` imports from openrlhf:

    from openrlhf.utils import extract_boxed_answer, grade_answer        # examples/python/math_reward_func.py
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor   # examples/python/agent_func.py

While openpack executes such a file (``openrlhf_names``), and only where openrlhf is not installed, those modules
are put in ``sys.modules`` and taken out again after the file has run its imports: a real openrlhf install is
never shadowed, and no other code sees the stand-ins. The agent classes live in ``rl/agents/openrlhf_compat``.

The math helpers are not OpenRLHF's code. ``extract_boxed_answer`` returns what the last ``\\boxed{...}`` (or
``\\fbox{...}``) of a text holds, braces balanced, or None, as OpenRLHF's does. ``grade_answer(given, truth)``
asks math-verify (Hugging Face's grader, ``pip install openpack[math]``) whether the two are the same answer,
each read as LaTeX (``$...$``): ``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``x^2+1`` = ``1+x^2``, ``(1,2)`` =
``(1, 2)``; None on either side is False. OpenRLHF grades with its own normaliser and sympy; the two agree on
plain numbers, fractions and expressions, and may differ on edge cases (units, text answers).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types


def extract_boxed_answer(solution: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``solution``, braces balanced; else None."""
    if not isinstance(solution, str):
        return None
    for command in ("\\boxed{", "\\fbox{"):
        start = solution.rfind(command)
        if start >= 0:
            break
    else:
        return None
    depth, first = 0, start + len(command)
    for i in range(first - 1, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[i], 0)
        if depth == 0:
            return solution[first:i]
    return None  # unbalanced: no answer


def grade_answer(given_answer, ground_truth) -> bool:
    """Whether ``given_answer`` is ``ground_truth`` as a math answer (math-verify; see the module docstring)."""
    if given_answer is None or ground_truth is None:
        return False
    given, truth = str(given_answer).strip(), str(ground_truth).strip()
    if given == truth:
        return True
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("grade_answer (openrlhf.utils, as openpack provides it) grades with math-verify: "
                          "pip install 'openpack[math]' (or pip install math-verify)") from err
    # math-verify's timeouts use signal.alarm, which works only in the main thread; elsewhere (openpack calls
    # rewards in a helper thread) --reward_timeout bounds the whole call instead.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(verify(parse(f"${truth}$", parsing_timeout=limit), parse(f"${given}$", parsing_timeout=limit),
                       timeout_seconds=limit))


@contextlib.contextmanager
def openrlhf_names():
    """``openrlhf``, ``openrlhf.utils`` (the math helpers) and ``openrlhf.utils.agent`` importable for the
    duration, where openrlhf is not installed; with it installed, nothing changes."""
    if importlib.util.find_spec("openrlhf") is not None:
        yield
        return
    from openpack.rl.agents import openrlhf_compat

    package, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    package.__path__, utils.__path__ = [], []  # packages, so that "import openrlhf.utils.agent" resolves
    package.utils, utils.agent = utils, openrlhf_compat
    utils.extract_boxed_answer, utils.grade_answer = extract_boxed_answer, grade_answer
    modules = {"openrlhf": package, "openrlhf.utils": utils, "openrlhf.utils.agent": openrlhf_compat}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)
