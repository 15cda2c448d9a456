"""Tracker: metrics.jsonl, plain progress lines, loss.png, TensorBoard and offline W&B, all on rank 0 only."""

import json

import pytest

from openpack.trainers.tracking import Tracker

STEPS = [
    {"loss": 2.5, "tokens_per_s": 1234.6, "packing_efficiency": 0.987},
    {"loss": 2.25, "tokens_per_s": 1300.0, "packing_efficiency": 0.99},
    {"loss": 2.0, "tokens_per_s": 1250.0, "packing_efficiency": 0.985, "eval_loss": 2.1},
]


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def run(tracker):
    with tracker:
        for step, metrics in enumerate(STEPS, start=1):
            tracker.log(step, metrics)


def test_metrics_jsonl_has_one_line_per_step_with_step_first(tmp_path):
    run(Tracker(str(tmp_path / "out"), total_steps=3))
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": i, **m} for i, m in enumerate(STEPS, start=1)]
    assert all(next(iter(row)) == "step" for row in rows)


def test_metrics_line_is_flushed_before_close(tmp_path):
    tracker = Tracker(str(tmp_path), total_steps=3)
    tracker.log(1, {"loss": 1.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.5}
    tracker.close()


def test_plain_progress_lines_when_not_a_terminal(tmp_path, capsys):
    run(Tracker(None, total_steps=3))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("step 2/3  loss 2.25  tokens/s 1300  packing 99.0%  eta ")
    assert lines[0].startswith("step 1/3  loss 2.5  tokens/s 1235  packing 98.7%  eta ")
    assert list(tmp_path.iterdir()) == []  # save_path None writes nothing


def test_message_prints_a_plain_line(capsys):
    with Tracker(None, total_steps=1) as tracker:
        tracker.message("saved checkpoint to /ckpt/step_1")
    assert capsys.readouterr().out == "saved checkpoint to /ckpt/step_1\n"


def test_disabled_tracker_creates_nothing_and_prints_nothing(tmp_path, capsys):
    out, tb = tmp_path / "out", tmp_path / "tb"
    tracker = Tracker(str(out), total_steps=3, enabled=False, use_wandb="offline", use_tensorboard=str(tb))
    run(tracker)
    tracker.message("hello")
    assert not out.exists() and not tb.exists()
    assert capsys.readouterr() == ("", "")


def test_loss_png_written_on_close(tmp_path):
    run(Tracker(str(tmp_path), total_steps=3))
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_no_loss_png_without_loss(tmp_path):
    with Tracker(str(tmp_path), total_steps=1) as tracker:
        tracker.log(1, {"tokens_per_s": 10.0})
    assert not (tmp_path / "loss.png").exists()


def test_tensorboard_writes_an_events_file(tmp_path):
    tb = tmp_path / "tb"
    run(Tracker(None, total_steps=3, use_tensorboard=str(tb)))
    assert list(tb.glob("events.out.tfevents.*"))


def test_wandb_offline_run_goes_under_save_path(tmp_path):
    run(Tracker(str(tmp_path), total_steps=3, use_wandb="offline", config={"beta": 0.1}))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_fresh_run_starts_a_new_metrics_file_and_resume_continues_it(tmp_path):
    from openpack.trainers.tracking import Tracker

    for steps, resume in (((1, 2), False), ((1,), False), ((2, 3), True)):
        with Tracker(str(tmp_path), 3, resume=resume) as tracker:
            for step in steps:
                tracker.log(step, {"loss": float(step)})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
