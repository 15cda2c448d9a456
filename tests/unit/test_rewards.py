"""Reward sources for online RL: a rule function from a file, OpenRLHF's remote protocol, exact match, and the
checks that name a bad source and batch instead of a traceback. The remote server is a real HTTP server on
127.0.0.1 in a thread; a closed port and a server that never answers are the failures."""

import http.server
import json
import socket
import threading
import time

import pytest

from openpack.trainers.rewards import RewardError, checked, exact_match_reward, load_reward_fn, remote_reward

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
    ("return ['high', 1]", "rule.py:bad returned \"['high', 1]\" on step 3"),
])
def test_a_bad_reward_names_the_function_and_the_batch(tmp_path, body, message):
    (tmp_path / "rule.py").write_text(f"def bad(prompts, completions, rows):\n    {body}\n")
    with pytest.raises(RewardError, match=message.replace("(", r"\(").replace("[", r"\[")):
        checked(load_reward_fn(f"{tmp_path}/rule.py:bad"))(PROMPTS, COMPLETIONS, ROWS, batch="step 3")


class _Server:
    """An HTTP reward server on loopback answering each POST with ``answer(payload)`` after ``delay`` seconds.

    ``close`` cuts a delay short and waits for every request's thread: a client that gave up (the hanging server's
    test) is answered into a closed socket, and that BrokenPipeError is swallowed, not printed by a thread still
    asleep when pytest has moved on or ended.
    """

    def __init__(self, answer, delay=0.0):
        outer = self
        self.requests, self.handlers, self.closing = [], [], threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                outer.handlers.append(threading.current_thread())
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(payload)
                outer.closing.wait(delay)
                body = json.dumps(answer(payload)).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = False  # so server_close joins the request threads
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_openrlhf_protocol_round_trip():
    server = _Server(lambda payload: {"rewards": [float(len(q)) for q in payload["query"]]})
    try:
        assert checked(remote_reward(server.url))(PROMPTS, COMPLETIONS, ROWS) == [5.0, 14.0]
        assert server.requests == [{"query": ["1+2=3", "07+35=it is 42"], "prompts": PROMPTS, "labels": [3, 42]}]
    finally:
        server.close()


def test_a_server_that_is_down_or_hangs_is_cut_off(capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/score"  # bound, not listening: refused
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"no answer after 3 tries .*check that the reward server is up"):
        remote_reward(closed, timeout_s=1, retries=2, pause_s=0.05)(PROMPTS, COMPLETIONS, ROWS)
    assert time.monotonic() - start < 5
    hanging = _Server(lambda payload: {"rewards": [0.0, 0.0]}, delay=5)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match="timeout 0.5 s each"):
            remote_reward(hanging.url, timeout_s=0.5, retries=1, pause_s=0.05)(PROMPTS, COMPLETIONS, ROWS)
        assert time.monotonic() - start < 4  # two tries of 0.5 s, not the server's 5 s
    finally:
        hanging.close()
    assert len(hanging.handlers) == 2 and not any(thread.is_alive() for thread in hanging.handlers)
    assert "Traceback" not in capfd.readouterr().err  # nothing left to print a BrokenPipeError after the test


def test_an_answer_without_rewards_is_named():
    server = _Server(lambda payload: {"scores": [1, 2]})
    try:
        with pytest.raises(RewardError, match="the answer has no 'rewards' list"):
            remote_reward(server.url, retries=0)(PROMPTS, COMPLETIONS, ROWS)
    finally:
        server.close()
