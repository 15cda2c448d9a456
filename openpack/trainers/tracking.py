"""What a user sees and keeps from a training run: a progress bar, metrics.jsonl, loss.png, W&B, TensorBoard.

Rank 0 builds ``Tracker(...)``; other ranks pass ``enabled=False`` and get a
tracker whose every method does nothing. ``metrics.jsonl`` is written and flushed after
every step, so a crash keeps every logged step (one small write per step, microseconds
against a step of a second or more). A run resumed at step N (``resume_step``) first drops
the rows past N (a crash after the last checkpoint logged them, and they are trained
again), so no step appears twice; TensorBoard purges its events past N and W&B continues
the run with the same id (``run_id``). The file is strict JSON: an inf or NaN (a skipped
step's loss) is written as null. On a terminal the progress is a live ``rich`` bar;
elsewhere (CI, pipes, ``nohup``) it is one greppable line per step::

    step 3/10  loss 2.346  tokens/s 1234  packing 98.7%  eta 0:00:12

Online RL adds ``reward``, ``distill/reverse_kl`` (with a distillation teacher) and ``vllm_logp_diff`` (the
sampler's log-probs against the trainer's), and a ``MetricLimit`` says once, above the message line, when that
difference first passes its bound.

The ETA is the time per step since the first logged training step, times the
steps left. The first step carries the warm-up (first allocations, lazy
kernel builds, autotuning on GPUs: in the 2-rank CPU test it ran at 5288
tokens/s against 18702 for the second) and so does the time before it, and
counting them skewed every early estimate. Until a second step there is no
estimate (``eta -:--:--``).

Under Ray, rank 0 runs in an actor whose stdout is a log file, so its
tracker prints nothing: it sends its console (steps and messages) to
``forward_console``'s callback, and the driver replays them on its own
terminal with ``ConsoleRelay``, the same display code a local run uses.

W&B never waits on the network: with ``use_wandb="offline"``, or a key but no
route to the W&B host (checked with a 3 s connect), the run is written offline
under ``save_path`` for a later ``wandb sync``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

PROGRESS_KEYS = ("loss", "reward", "distill/reverse_kl", "tokens_per_s", "packing_efficiency", "vllm_logp_diff")


def format_metric(key: str, value: float) -> str:
    """``loss 2.346``, ``tokens/s 1234``, ``packing 98.7%`` (efficiency is a fraction in [0, 1]),
    ``vllm_logp_diff 1.2e-07``."""
    if key == "tokens_per_s":
        return f"tokens/s {value:.0f}"
    if key == "packing_efficiency":
        return f"packing {value:.1%}"
    if key == "vllm_logp_diff":
        return f"{key} {value:.1e}"
    return f"{key} {value:.4g}"


@dataclass
class MetricLimit:
    """A warning line said once, the first time a logged ``key`` is above ``limit``; later steps stay quiet (the
    metric stays in the progress line and metrics.jsonl)."""

    key: str
    limit: float
    advice: str
    said: bool = False

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        value = metrics.get(self.key)
        if self.said or value is None or not value > self.limit:
            return None
        self.said = True
        return (f"warning: {self.key} {value:.1e} at step {step} is above {self.limit:g}: {self.advice} "
                "(said once; the value stays in the progress line)")


def metric_tag(key: str) -> str:
    """TensorBoard/W&B tag: ``eval_loss`` -> ``eval/loss``, anything else ``loss`` -> ``train/loss``."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


def wandb_reachable(timeout_s: float = 3.0) -> bool:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class ProgressDisplay:
    """A run's console: a live bar on a terminal, else one plain line per logged step; ``message`` lines above it.

    ``step(..., at=t)`` takes the time the step ended on the clock of the process that ran it (rank 0 under
    Ray), so the driver's polling delay never enters the ETA; a local run leaves it to ``time.monotonic()``.
    """

    def __init__(self, total_steps: int, console: Console | None = None, progress_keys: tuple = PROGRESS_KEYS):
        self.total_steps, self.progress_keys = total_steps, tuple(progress_keys)
        self.console = console or Console()
        self.first: tuple[int, float] | None = None  # the first logged training step and when it ended
        self.progress = None
        if self.console.is_terminal:
            self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.fields[metrics]}"), TextColumn("eta {task.fields[eta]}"),
                                     console=self.console)
            self.task = self.progress.add_task("train", total=total_steps, metrics="", eta=_NO_ETA)
            self.progress.start()

    def step(self, step: int, metrics: dict[str, float], at: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        shown = "  ".join(format_metric(k, metrics[k]) for k in self.progress_keys if k in metrics)
        eta = self._eta(step, at, training=bool(shown))
        if self.progress is not None:
            self.progress.update(self.task, completed=step, metrics=shown, eta=eta)
            return
        if not shown:  # an evaluation row: the command reports its numbers in a message line
            return
        parts = [f"step {step}/{self.total_steps}", shown, f"eta {eta}"]
        self.console.print("  ".join(p for p in parts if p), markup=False, highlight=False, soft_wrap=True)

    def _eta(self, step: int, at: float, training: bool) -> str:
        """Time per step since the first training step (not counting its warm-up) x steps left."""
        if training and self.first is None:
            self.first = (step, at)
        if self.first is None or step <= self.first[0]:
            return _NO_ETA
        per_step = (at - self.first[1]) / (step - self.first[0])
        return str(datetime.timedelta(seconds=int(per_step * max(self.total_steps - step, 0))))

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


_NO_ETA = "-:--:--"


class ForwardedConsole:
    """Rank 0's console under Ray: the same calls as ``ProgressDisplay``, sent as events to the driver."""

    def __init__(self, send, total_steps: int, progress_keys: tuple):
        self.send, self.progress_keys = send, tuple(progress_keys)
        send(("open", total_steps, self.progress_keys))

    def step(self, step: int, metrics: dict[str, float], at: float | None = None) -> None:
        shown = {k: metrics[k] for k in self.progress_keys if k in metrics}
        self.send(("step", step, shown, time.monotonic() if at is None else at))

    def message(self, text: str) -> None:
        self.send(("message", text))

    def close(self) -> None:
        self.send(("close",))


class ConsoleRelay:
    """The driver's side: shows the events rank 0's ``ForwardedConsole`` sent, on a ``ProgressDisplay`` of its own."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.display: ProgressDisplay | None = None

    def show(self, event: tuple) -> None:
        kind, *args = event
        if kind == "open":
            self.close()
            self.display = ProgressDisplay(args[0], self.console, args[1])
        elif kind == "step" and self.display is not None:
            self.display.step(*args)
        elif kind == "message":
            self.console.print(args[0], markup=False, highlight=False, soft_wrap=True)
        elif kind == "close":
            self.close()

    def close(self) -> None:
        if self.display is not None:
            self.display.close()
            self.display = None


_forward_to = None  # set in a Ray rank 0 actor: where its Tracker sends its console


def forward_console(send) -> None:
    """Make this process's next Trackers send their console to ``send(event)`` instead of printing (None: print)."""
    global _forward_to
    _forward_to = send


def json_line(record: dict) -> str:
    """``record`` as strict JSON: an inf or NaN (a skipped step's loss, ``distributed/nonfinite.py``) is written as
    null, which every JSON parser reads, where Python's default ``NaN`` is not JSON."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()},
                      allow_nan=False)


class Tracker:
    """Progress, metrics.jsonl, loss.png, W&B and TensorBoard for one run; a no-op when ``enabled=False``."""

    def __init__(self, save_path: str | None, total_steps: int, enabled: bool = True,
                 use_wandb: str | None = None, wandb_project: str = "openpack", wandb_run_name: str | None = None,
                 use_tensorboard: str | None = None, config: dict | None = None,
                 progress_keys: tuple = PROGRESS_KEYS, console=None,
                 resume_step: int = 0, run_id: str | None = None):
        self.enabled, self.closed = enabled, False
        if not enabled:
            return
        self.save_path, self.total_steps = save_path, total_steps
        self.display = (ForwardedConsole(_forward_to, total_steps, progress_keys) if _forward_to and console is None
                        else ProgressDisplay(total_steps, console, progress_keys))
        self.history: dict[str, list[tuple[int, float]]] = {"loss": [], "eval_loss": [], "reward": []}
        self.limits: list[MetricLimit] = []
        self.metrics_file = None
        if save_path is not None:
            os.makedirs(save_path, exist_ok=True)
            path = os.path.join(save_path, "metrics.jsonl")
            if resume_step and os.path.exists(path):  # the plot covers the whole run, not just this part
                self._keep_rows_until(path, resume_step)
                self._reload_history(path)
            # a resumed run continues its file; a fresh run into the same folder starts a new one
            self.metrics_file = open(path, "a" if resume_step else "w", encoding="utf-8")
        self.wandb_run = (self._init_wandb(use_wandb, wandb_project, wandb_run_name, config, run_id)
                          if use_wandb else None)
        self.tb_writer = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the earlier events at steps >= it, which the resumed run logs again
            self.tb_writer = SummaryWriter(log_dir=use_tensorboard, purge_step=resume_step + 1 if resume_step else None)

    def _init_wandb(self, use_wandb: str, project: str, name: str | None, config: dict | None, run_id: str | None):
        import wandb

        run_dir = self.save_path or tempfile.mkdtemp(prefix="openpack-wandb-")
        # The run id of the save path (run.json): a resumed run continues its W&B run. Online, W&B keeps
        # the steps it already has and ignores a re-logged step at or below them (with a warning), so
        # steps logged after the last checkpoint keep their first values there; metrics.jsonl and
        # TensorBoard are rewound exactly. Offline, each part is its own folder with this id.
        same_run = {"id": run_id, "resume": "allow"} if run_id else {}
        if use_wandb != "offline":
            try:
                if not wandb_reachable():
                    raise ConnectionError("W&B host unreachable")
                wandb.login(key=use_wandb)
                return wandb.init(project=project, name=name, config=config, dir=run_dir, **same_run)
            except Exception as err:  # no network, bad key, W&B outage: keep training, log offline
                self.message(f"wandb: cannot go online ({err}); logging offline")
        run = wandb.init(project=project, name=name, config=config, dir=run_dir,
                         settings=wandb.Settings(mode="offline"), **same_run)
        self.message(f"wandb: offline run; upload later with `wandb sync {os.path.dirname(run.dir)}`")
        return run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step everywhere: jsonl line, progress, W&B, TensorBoard, loss history."""
        if not self.enabled:
            return
        metrics = {k: v if isinstance(v, int) else float(v) for k, v in metrics.items()}
        if self.metrics_file is not None:
            self.metrics_file.write(json_line({"step": step, **metrics}) + "\n")
            self.metrics_file.flush()
        for key in self.history:
            if key in metrics:
                self.history[key].append((step, metrics[key]))
        if self.wandb_run is not None:
            self.wandb_run.log({metric_tag(k): v for k, v in metrics.items()}, step=step)
        if self.tb_writer is not None:
            for key, value in metrics.items():
                self.tb_writer.add_scalar(metric_tag(key), value, step)
        self.display.step(step, metrics)
        for limit in self.limits:
            line = limit.check(step, metrics)
            if line:
                self.message(line)

    def watch(self, limit: MetricLimit) -> None:
        """Warn once when ``limit.key`` first goes above ``limit.limit`` in a logged step."""
        if self.enabled:
            self.limits.append(limit)

    def message(self, text: str) -> None:
        """Print a line above the progress bar (or plainly when there is none)."""
        if self.enabled:
            self.display.message(text)

    @staticmethod
    def _keep_rows_until(path: str, step: int) -> None:
        """Drop the rows of steps after ``step`` from ``path``, atomically (a crash leaves the old file whole)."""
        kept = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):  # a line cut short by the crash
                    continue
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)

    def _reload_history(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                for key in self.history:
                    if key in record:  # null: a non-finite value (json_line), a gap in the plot
                        self.history[key].append((record["step"], math.nan if record[key] is None else record[key]))

    def close(self) -> None:
        """Finish the bar, write loss.png, close metrics.jsonl, W&B and TensorBoard. Safe to call twice."""
        if not self.enabled or self.closed:
            return
        self.closed = True
        self.display.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.save_path is not None and self.history["loss"]:
            self._write_plot(os.path.join(self.save_path, "loss.png"), "loss", {"loss": "train loss",
                                                                                "eval_loss": "eval loss"})
        if self.save_path is not None and self.history["reward"]:  # online RL: the curve that matters
            self._write_plot(os.path.join(self.save_path, "reward.png"), "mean reward", {"reward": "rollout reward"})
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tb_writer is not None:
            self.tb_writer.close()

    def _write_plot(self, path: str, ylabel: str, series: dict[str, str]) -> None:
        """A PNG of the ``series`` (history key -> label) over steps."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # not pyplot: no global backend, no display
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key, label in series.items():
            if self.history[key]:
                steps, values = zip(*self.history[key])
                ax.plot(steps, values, label=label, marker="o" if key == "eval_loss" else None)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        tmp = path + ".tmp"
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)  # a reader never sees a half-written plot

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
