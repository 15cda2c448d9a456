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

    for steps, resume_step in (((1, 2), 0), ((1,), 0), ((2, 3), 1)):
        with Tracker(str(tmp_path), 3, resume_step=resume_step) as tracker:
            for step in steps:
                tracker.log(step, {"loss": float(step)})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_resume_drops_the_rows_past_the_resumed_step(tmp_path):
    """A crash after step 4 was logged but with step 2 the last checkpoint: steps 3-4 are trained again."""
    rows = [json.dumps({"step": s, "loss": 10.0 + s}) for s in (1, 2, 3, 4)] + ['{"step": 5, "lo']  # cut by the crash
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows))
    with Tracker(str(tmp_path), 4, resume_step=2) as tracker:
        for step in (3, 4):
            tracker.log(step, {"loss": float(step)})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 11.0}, {"step": 2, "loss": 12.0}, {"step": 3, "loss": 3.0},
                     {"step": 4, "loss": 4.0}]
    assert not list(tmp_path.glob("*.tmp"))


def test_tensorboard_purges_the_steps_past_the_resumed_one(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    for steps, resume_step, loss in (((1, 2, 3, 4), 0, 10.0), ((3, 4), 2, 1.0)):
        with Tracker(None, 4, use_tensorboard=str(tb), resume_step=resume_step) as tracker:
            for step in steps:
                tracker.log(step, {"loss": loss + step})
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (3, 4.0), (4, 5.0)]


def test_wandb_continues_the_same_run_id(tmp_path):
    for resume_step in (0, 2):
        with Tracker(str(tmp_path), 4, use_wandb="offline", resume_step=resume_step, run_id="0123456789ab") as tracker:
            tracker.log(resume_step + 1, {"loss": 1.0})
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all("-0123456789ab" in run.name for run in runs), runs  # same second: "-1" added
