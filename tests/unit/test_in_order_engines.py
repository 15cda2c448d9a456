"""``generation.InOrder``: in-process engines under --async_train run every call on one thread, in the order the
calls were made, as a Ray actor of one thread does. A multi-turn episode asks for its next turn from its own
thread while the trainer loads weights; that turn must run after the load (vLLM's in-process engine core is not
thread-safe), not beside it.

The group here is a recorder standing in for ``EngineGroup(remote=False)``: what is under test is the ordering.
"""

import threading

from openpack.rl.generation import InOrder


class Recorder:
    """An engine group that logs which thread runs each call and whether two calls ever overlap; ``update_weights``
    holds until ``release`` is set, so another call can be made while it runs."""

    in_flight = False

    def __init__(self):
        self.log, self.running = [], 0
        self.lock = threading.Lock()
        self.update_started, self.release = threading.Event(), threading.Event()
        self.overlapped = False

    def _enter(self, name):
        with self.lock:
            self.running += 1
            self.overlapped |= self.running > 1
            self.log.append((name, threading.current_thread().name))

    def _leave(self):
        with self.lock:
            self.running -= 1

    def generate(self, prompts, sampling, seeds):
        self._enter(f"generate {prompts[0]}")
        self._leave()
        return [[prompts[0]]]

    def update_weights(self, bucket):
        self._enter(f"update {bucket}")
        self.update_started.set()
        self.release.wait()
        self._leave()
        return bucket


def test_a_turn_asked_for_while_weights_load_runs_after_the_load_on_the_same_thread():
    group = Recorder()
    engines = InOrder(group)
    first = engines.start_generate(["turn 1"], None, [0])
    assert first() == [["turn 1"]]

    done = []
    loader = threading.Thread(target=lambda: done.append(engines.update_weights("v1")))
    loader.start()
    assert group.update_started.wait(60), "update_weights never started"
    second = engines.start_generate(["turn 2"], None, [1])  # the episode's next turn, asked for mid-load
    group.release.set()
    assert second() == [["turn 2"]]
    loader.join(60)

    assert done == ["v1"]
    assert [name for name, _ in group.log] == ["generate turn 1", "update v1", "generate turn 2"]
    assert not group.overlapped
    threads = {thread for _, thread in group.log}
    assert len(threads) == 1 and threads.pop().startswith("openpack-rollouts")


def test_attributes_pass_through_and_in_flight_calls_skip_the_queue():
    group = Recorder()
    group.in_flight = True
    group.update_weights = lambda bucket: threading.current_thread().name  # a weights group's call: at once
    engines = InOrder(group)
    assert engines.in_flight is True
    assert engines.update_weights("v1") == threading.current_thread().name
