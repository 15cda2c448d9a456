"""The console of a run: plain lines or a live bar, an ETA that leaves out the warm-up, and Ray's rank 0 forwarding
its console to the driver, which shows exactly what a local run shows (issue 12, item 6).

A fake clock stands in for ``time.monotonic``: 100 s of warm-up (model load, kernel builds) before step 1 ends,
then 2 s per step.
"""

import io

import pytest
from rich.console import Console

from openpack.trainers import tracking
from openpack.trainers.tracking import Tracker

STEP = {"loss": 2.25, "tokens_per_s": 1300.0, "packing_efficiency": 0.99}


@pytest.fixture
def clock(monkeypatch):
    """``clock.now`` is what time.monotonic() returns; the tracker is built at 0."""

    class Clock:
        now = 0.0

    monkeypatch.setattr(tracking.time, "monotonic", lambda: Clock.now)
    return Clock


def plain_console():
    return Console(file=io.StringIO(), force_terminal=False, width=200)


def train(tracker, clock, steps=(1, 2, 3), warmup=100.0, per_step=2.0):
    """Log ``steps``: the first ends after the warm-up, the others ``per_step`` apart."""
    with tracker:
        for i, step in enumerate(steps):
            clock.now = warmup + i * per_step
            tracker.log(step, STEP)


def test_eta_leaves_out_the_warm_up(clock):
    """After step 3 of 10: 2 s per step since step 1, 7 steps left -> 14 s. Counting the warm-up (104 s over 3 steps,
    what the tracker did before) said 0:04:02."""
    console = plain_console()
    train(Tracker(None, total_steps=10, console=console), clock)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "step 1/10  loss 2.25  tokens/s 1300  packing 99.0%  eta -:--:--"  # no estimate from 1 step
    assert lines[1].endswith("eta 0:00:16")
    assert lines[2].endswith("eta 0:00:14")


def test_eta_of_a_resumed_run_counts_only_its_own_steps(clock):
    console = plain_console()
    train(Tracker(None, total_steps=10, console=console), clock, steps=(6, 7, 8))
    assert console.file.getvalue().splitlines()[2].endswith("eta 0:00:04")


def test_evaluation_rows_do_not_start_the_clock(clock):
    """The demo logs held-out accuracy at step 0 before training: that is not a training step."""
    console = plain_console()
    with Tracker(None, total_steps=10, console=console) as tracker:
        tracker.log(0, {"eval_exact_match": 0.0})
        for i, step in enumerate((1, 2)):
            clock.now = 100.0 + 2.0 * i
            tracker.log(step, STEP)
    lines = console.file.getvalue().splitlines()
    assert lines[-1].endswith("eta 0:00:16")
    assert len(lines) == 2 and lines[0].startswith("step 1/10  loss")  # no plain line for the evaluation row


def test_live_bar_on_a_terminal_shows_step_metrics_and_eta(clock):
    console = Console(file=io.StringIO(), force_terminal=True, width=150, color_system=None)
    train(Tracker(None, total_steps=10, console=console), clock)
    out = console.file.getvalue()
    assert "3/10" in out and "loss 2.25  tokens/s 1300  packing 99.0%" in out and "eta 0:00:14" in out
    assert "step 3/10  loss" not in out  # a bar, not the plain lines


def test_forwarded_console_shows_on_the_driver_as_a_local_run_shows_it(clock):
    """Under Ray rank 0 sends its console to the driver (``forward_console``); the driver's ``ConsoleRelay``
    replays it with the same display code: same lines, same ETA (rank 0's clock), messages in order."""
    local = plain_console()
    train(Tracker(None, total_steps=10, console=local), clock)
    local.print("model saved to /x", markup=False, highlight=False)

    events = []
    tracking.forward_console(events.append)
    try:
        tracker = Tracker(None, total_steps=10)
        train(tracker, clock)
        tracker.message("model saved to /x")
    finally:
        tracking.forward_console(None)
    driver = plain_console()
    relay = tracking.ConsoleRelay(driver)
    clock.now = 1e6  # the driver's own clock never enters the ETA
    for event in events:
        relay.show(event)
    relay.close()
    assert driver.file.getvalue() == local.file.getvalue()


def test_rank_zero_prints_nothing_itself_when_forwarding(clock, capsys):
    tracking.forward_console(lambda event: None)
    try:
        train(Tracker(None, total_steps=3), clock)
    finally:
        tracking.forward_console(None)
    assert capsys.readouterr() == ("", "")


def test_rl_steps_show_vllm_logp_diff_and_warn_once_above_its_limit(clock):
    """vllm_logp_diff was only in metrics.jsonl (issue 24): now in the progress line, and the first step above the
    limit (fp32: 1e-3) says so in one line; later steps above it stay quiet, the value still in their lines."""
    from openpack.rl.worker import logp_diff_limit

    console = plain_console()
    with Tracker(None, total_steps=4, console=console) as tracker:
        tracker.watch(logp_diff_limit(bf16=False))
        for step, diff in enumerate((1.2e-7, 2e-4, 0.013, 0.02), start=1):
            tracker.log(step, {"loss": 0.5, "reward": 1.0, "vllm_logp_diff": diff})
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "step 1/4  loss 0.5  reward 1  vllm_logp_diff 1.2e-07  eta -:--:--"
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and lines.index(warnings[0]) == 3  # right after step 3's line
    assert warnings[0].startswith("warning: vllm_logp_diff 1.3e-02 at step 3 is above 0.001: the sampler's log-probs")
    assert "vllm_logp_diff 2.0e-02" in lines[4]


@pytest.mark.parametrize("bf16, quiet, loud", [(False, 9e-4, 1.1e-3), (True, 0.09, 0.11)])
def test_the_logp_diff_limit_is_the_documented_one(bf16, quiet, loud):
    """docs/rl.md: 1e-3 in fp32 (runs stay at 1e-7 to 1e-5, a tied head that missed the sync gave 0.013), 0.1 in
    bf16 (its rounding alone gives up to about 0.08)."""
    from openpack.rl.worker import logp_diff_limit

    limit = logp_diff_limit(bf16)
    assert limit.check(1, {"vllm_logp_diff": quiet}) is None
    assert limit.check(2, {"loss": 1.0}) is None  # a step without the metric (an update dynamic filtering skipped)
    assert limit.check(3, {"vllm_logp_diff": loud}) is not None
    assert limit.check(4, {"vllm_logp_diff": loud}) is None  # once
