"""Reward sources for online RL: a rule function from a file, OpenRLHF's remote protocol, exact match, and the
checks that name a bad source and batch instead of a traceback. The remote server is a real HTTP server on
127.0.0.1 in a thread; a closed port and a server that never answers are the failures."""

import re
import socket

import pytest

from openpack.rl.rewards import RewardError, checked, exact_match_reward, load_reward_fn, remote_reward
from reward_server import RewardServer

PROMPTS, COMPLETIONS = ["1+2=", "07+35="], ["3", "it is 42"]
ROWS = [{"prompt": "1+2=", "response": "3", "label": 3}, {"prompt": "07+35=", "response": "42", "label": 42}]


def test_exact_match_rewards_the_bare_right_answer():
    assert checked(exact_match_reward)(PROMPTS, COMPLETIONS, ROWS) == [1.0, 0.0]


def test_a_reward_function_from_a_file(tmp_path):
    (tmp_path / "rule.py").write_text("def length(prompts, completions, rows):\n"
                                      "    return [len(c) for c in completions]\n")
    assert checked(load_reward_fn(f"{tmp_path}/rule.py:length"))(PROMPTS, COMPLETIONS, ROWS) == [1.0, 8.0]
    with pytest.raises(RewardError, match="has no function 'missing'"):
        load_reward_fn(f"{tmp_path}/rule.py:missing")
    with pytest.raises(RewardError, match="no file"):
        load_reward_fn(f"{tmp_path}/nope.py:length")


@pytest.mark.parametrize("body,message", [
    ("raise KeyError('label')", "rule.py:bad raised KeyError: 'label' (on step 3"),
    ("return [1.0]", "rule.py:bad returned 1 rewards for 2 completions on step 3"),
    ("return [1.0, float('nan')]", "rule.py:bad returned nan for completion 1 of step 3"),
    ("return [float('-inf'), 1.0]", "rule.py:bad returned -inf for completion 0 of step 3"),
    ("return [1, 'high']", "rule.py:bad returned 'high' (a str) for completion 1 of step 3"),
    ("return [1, '0.5']", "rule.py:bad returned '0.5' (a str) for completion 1 of step 3"),
    ("return 1.0", "rule.py:bad returned '1.0' on step 3: expected a list"),
])
def test_a_bad_reward_names_the_function_and_the_batch(tmp_path, body, message):
    (tmp_path / "rule.py").write_text(f"def bad(prompts, completions, rows):\n    {body}\n")
    with pytest.raises(RewardError, match=re.escape(message)):
        checked(load_reward_fn(f"{tmp_path}/rule.py:bad"))(PROMPTS, COMPLETIONS, ROWS, batch="step 3")


def test_openrlhf_protocol_round_trip():
    server = RewardServer(lambda payload: {"rewards": [float(len(q)) for q in payload["query"]]})
    try:
        assert checked(remote_reward(server.url))(PROMPTS, COMPLETIONS, ROWS) == [5.0, 14.0]
        assert server.requests == [{"query": ["1+2=3", "07+35=it is 42"], "prompts": PROMPTS, "labels": [3, 42]}]
    finally:
        server.close()


def test_a_server_that_is_down_or_hangs_is_cut_off(capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/score"  # bound, not listening: refused
    with pytest.raises(RewardError, match=r"no answer after 3 tries .*check that the reward server is up"):
        remote_reward(closed, timeout_s=1, retries=2, pause_s=0.05)(PROMPTS, COMPLETIONS, ROWS)
    # The server would answer only after 10 minutes (close cuts that short): the call ends because both tries timed
    # out, which the error says; a time bound would only fail on a loaded machine.
    hanging = RewardServer(lambda payload: {"rewards": [0.0, 0.0]}, delay=600)
    try:
        with pytest.raises(RewardError, match="no answer after 2 tries .*timeout 0.5 s each"):
            remote_reward(hanging.url, timeout_s=0.5, retries=1, pause_s=0.05)(PROMPTS, COMPLETIONS, ROWS)
    finally:
        hanging.close()
    assert len(hanging.handlers) == 2 and not any(thread.is_alive() for thread in hanging.handlers)
    assert "Traceback" not in capfd.readouterr().err  # nothing left to print a BrokenPipeError after the test


def test_an_answer_without_rewards_is_named():
    server = RewardServer(lambda payload: {"scores": [1, 2]})
    try:
        with pytest.raises(RewardError, match="the answer has no 'rewards' list"):
            remote_reward(server.url, retries=0)(PROMPTS, COMPLETIONS, ROWS)
    finally:
        server.close()


def test_a_reward_function_that_hangs_is_cut_off_by_its_timeout(tmp_path):
    """--reward_timeout bounds one call: the function runs in a thread, and the run stops waiting for it (had it
    waited, the function would have returned None after 10 s, another error)."""
    (tmp_path / "rule.py").write_text("import time\ndef slow(prompts, completions, rows):\n    time.sleep(10)\n")
    with pytest.raises(RewardError, match=r"rule.py:slow gave no answer within --reward_timeout 0.5 s on step 3 "
                                          r"\(2 completions\)"):
        checked(load_reward_fn(f"{tmp_path}/rule.py:slow"), 0.5)(PROMPTS, COMPLETIONS, ROWS, batch="step 3")


@pytest.mark.parametrize("reply,tries,message", [
    ((422, b'{"detail": "labels missing"}'), 1,
     'answered HTTP 422 Unprocessable Entity, body \'{"detail": "labels missing"}\'; fix the request'),
    ((503, b"overloaded"), 3, "no answer after 3 tries (HTTP 503 Service Unavailable, body 'overloaded'"),
    ((200, b"<html>" + b"x" * 300), 1, "the answer is not JSON (Expecting value: line 1 column 1 (char 0)): "
                                       "'<html>xxx"),
])
def test_a_server_error_says_what_came_back(reply, tries, message):
    """A 4xx is final, a 5xx is retried, a body that is not JSON is quoted (its first 200 bytes, then its size)."""
    with RewardServer(lambda payload: reply) as server:
        with pytest.raises(RewardError) as err:
            remote_reward(server.url, retries=2, pause_s=0.01)(PROMPTS, COMPLETIONS, ROWS)
    assert message in str(err.value), str(err.value)
    assert "check that the reward server is up" not in str(err.value)
    assert len(server.requests) == tries
    if reply[1].startswith(b"<html>"):
        assert str(err.value).count("x") < 220 and "(306 bytes)" in str(err.value)
