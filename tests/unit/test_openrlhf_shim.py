"""The openrlhf names OpenRLHF's reward and agent files import, as openpack provides them (rl/openrlhf_shim), and
how a reward file's answer is read (issue 41 item 3)."""

import importlib.util
import sys

import pytest
import torch

from openpack.rl.openrlhf_shim import extract_boxed_answer, grade_answer, openrlhf_names
from openpack.rl.rewards import RewardError, _openrlhf_answer


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one, braces balanced
    ("\\fbox{x+1}", "x+1"),
    ("no box here", None),
    ("\\boxed{unclosed", None),
    (None, None),
])
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize("given,truth,expected", [
    ("42", "42", True), ("42", 42, True), (None, "1", False), ("1", None, False),  # no grader needed
    ("\\frac{1}{2}", "0.5", True), ("1/2", "\\frac12", True), ("1+x^2", "x^2+1", True), ("(1, 2)", "(1,2)", True),
    ("10", "11", False), ("\\sqrt{2}", "1.41", False),
])
def test_grade_answer(given, truth, expected):
    if not (given == truth or str(given) == str(truth) or None in (given, truth)):
        pytest.importorskip("math_verify")
    assert grade_answer(given, truth) is expected


def test_the_names_exist_only_while_a_file_loads_and_never_shadow_openrlhf():
    if importlib.util.find_spec("openrlhf") is not None:
        pytest.skip("openrlhf is installed: its own modules are used")
    with openrlhf_names():
        from openrlhf.utils import extract_boxed_answer as extract
        from openrlhf.utils.agent import MultiTurnAgentExecutor

        assert extract is extract_boxed_answer and MultiTurnAgentExecutor.__module__.startswith("openpack.")
    assert not any(name == "openrlhf" or name.startswith("openrlhf.") for name in sys.modules)


@pytest.mark.parametrize("answer,expected", [
    ({"rewards": torch.tensor([0.5]), "scores": torch.tensor([1.0]), "extra_logs": {}}, (0.5, 1.0, {})),
    ({"rewards": torch.tensor([0.5]), "extra_logs": {"acc": torch.tensor([1.0])}}, (0.5, None, {"acc": 1.0})),
    ({"rewards": torch.tensor(0.5)}, (0.5, None, {})),
    ({"rewards": [1.0]}, (1.0, None, {})),
    (torch.tensor([2.0]), (2.0, None, {})),
    (3, (3, None, {})),
])
def test_a_reward_files_answer_is_read_as_openrlhf_reads_it(answer, expected):
    """(reward, score or None, extra_logs) of one query."""
    assert _openrlhf_answer(answer, "r.py") == expected


@pytest.mark.parametrize("answer,expected", [
    ({"scores": [1.0]}, "returned a dict without 'rewards' (keys ['scores'])"),
    ("good", "returned str 'good'"),
    (torch.tensor([1.0, 2.0]), "returned Tensor"),
    (None, "returned NoneType"),
])
def test_a_reward_files_wrong_answer_names_the_file_and_the_answer(answer, expected):
    with pytest.raises(RewardError) as err:
        _openrlhf_answer(answer, "r.py")
    assert str(err.value).startswith("--remote_rm_url r.py: reward_func") and expected in str(err.value)
