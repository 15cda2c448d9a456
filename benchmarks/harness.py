"""What the openpack-vs-TRL benchmarks share: scaled data, saved models, measured subprocesses, docs sections.

Every arm of a benchmark runs in a fresh subprocess, so its peak resident
memory (``ru_maxrss`` of the process itself, recorded as it exits) is that
arm's alone, and the arms are interleaved (A B A B ...) so that slow drift on
a shared machine hits each arm alike. The trade-off: each run pays its own
Python, torch and transformers start-up (5-10 s here), so step timings come
from each framework's own step timer, skip the first step and never include
start-up.

Data is the ANCHORS benchmark length mix (``packing.generate_lengths``) with
every length divided by ``scale``, written as text of the demo tokenizer's
characters: one character is one token, so the lengths survive tokenization
exactly in both frameworks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
sys.path.insert(0, str(REPO / "benchmarks"))

from packing import ROW_CAP, PairLengths, generate_lengths, mix_description

from openpack.data.demo_tokenizer import CHARACTERS

LIBRARIES = ("torch", "transformers", "trl", "deepspeed", "datasets")


def scaled_lengths(pairs: int, scale: int, seed: int = 0) -> PairLengths:
    """The ANCHORS mix with every length divided by ``scale`` (rounded); rows stay <= ROW_CAP / scale.

    Responses keep at least 2 tokens (a character and the eos both frameworks
    append), so chosen and rejected can always differ.
    """
    full = generate_lengths(pairs, seed)
    row_cap = ROW_CAP // scale
    prompt = np.maximum(1, np.rint(full.prompt / scale)).astype(np.int64)
    room = row_cap - prompt

    def response(lengths):
        return np.minimum(np.maximum(2, np.rint(lengths / scale)), room).astype(np.int64)

    return PairLengths(prompt, response(full.chosen), response(full.rejected))


def scaled_mix_description(scale: int) -> str:
    return f"the ANCHORS benchmark length mix ({mix_description()}) with every length divided by {scale}"


def _text(rng: np.random.Generator, length: int) -> str:
    return "".join(CHARACTERS[i] for i in rng.integers(0, len(CHARACTERS), length))


def preference_rows(lengths: PairLengths, seed: int = 0) -> list[dict]:
    """Rows {prompt, chosen, rejected} of random characters; each response is its length minus the eos.

    The two responses differ in their first character, so no pair is dropped
    for having equal completions.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for prompt, chosen, rejected in zip(lengths.prompt, lengths.chosen, lengths.rejected):
        good, bad = _text(rng, int(chosen) - 1), _text(rng, int(rejected) - 1)
        if bad[0] == good[0]:
            bad = CHARACTERS[(CHARACTERS.index(bad[0]) + 1) % len(CHARACTERS)] + bad[1:]
        rows.append({"prompt": _text(rng, int(prompt)), "chosen": good, "rejected": bad})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@dataclass
class ModelSpec:
    """A small Llama built from a config (random init), fp32."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    max_position_embeddings: int = 4096

    def overrides(self) -> dict:
        return {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "max_position_embeddings": self.max_position_embeddings}

    def describe(self) -> str:
        return (f"Llama, {self.num_hidden_layers} layers, width {self.hidden_size}, MLP {self.intermediate_size}, "
                f"4 query / 2 KV heads, untied LM head, vocab {self.vocab_size} (the tokenizer uses 46 of them); "
                f"{self.parameters() / 1e6:.1f}M parameters; the LM head is {self.head_share():.0%} of "
                "the weight matmuls per token")

    def head_share(self) -> float:
        """The LM head's share of the weight matmuls per token."""
        head = self.vocab_size * self.hidden_size
        return head / (head + self.num_hidden_layers * self._layer_params())

    def parameters(self) -> int:
        """Weights of the embedding, the layers and the LM head (norms left out: < 0.1%)."""
        return 2 * self.vocab_size * self.hidden_size + self.num_hidden_layers * self._layer_params()

    def lora_parameters(self, rank: int) -> int:
        """Adapter weights at ``rank`` on every linear layer of the decoder (peft's all-linear: not the LM head)."""
        h, i = self.hidden_size, self.intermediate_size
        # rank x (in + out) per linear: q, o (h -> h); k, v (h -> h/2); gate, up (h -> i); down (i -> h)
        return self.num_hidden_layers * rank * (2 * 2 * h + 2 * (h + h // 2) + 3 * (h + i))

    def _layer_params(self) -> int:
        h = self.hidden_size
        return 2 * h * h + 2 * h * (h // 2) + 3 * h * self.intermediate_size  # q, o; k, v (2 of 4 heads); MLP


def save_models(folder: Path, spec: ModelSpec, seeds: list[int]) -> list[Path]:
    """One saved model folder (weights + demo tokenizer) per seed, loadable by openpack and TRL alike."""
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.tiny import tiny_causal_lm

    tokenizer = build_demo_tokenizer()
    tokenizer.model_max_length = spec.max_position_embeddings
    paths = []
    for seed in seeds:
        path = folder / f"llama_seed{seed}"
        # plain "sdpa" in the saved config: TRL loads it as any HF model; openpack loads it with its own attention
        model = tiny_causal_lm("llama", seed=seed, vocab_size=spec.vocab_size, attn_implementation="sdpa",
                               **spec.overrides())
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths


# A caller that trained in-process (a test) has these set for its own one-rank group; an arm is its own process.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "OPENPACK_ONE_PROCESS_GROUP")


def subprocess_env(threads: int) -> dict:
    """The same thread count and no GPU for every arm; the checkout on the path; no inherited process group."""
    return {
        **{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS},
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONWARNINGS": "ignore",
    }


@dataclass
class Measured:
    returncode: int
    peak_rss_mb: float  # the process's own peak resident memory
    wall_s: float
    log: Path


def run_measured(argv: list[str], log: Path, env: dict) -> Measured:
    """Run ``python ARGV`` (a script and its arguments, or ``-m module ...``) in a fresh process.

    The process records its own peak RSS (``VmHWM``, its address space's high-water mark) on exit: a child it
    spawns (DeepSpeed compiling its CPU comm op on a fresh machine runs a
    1.4 GB compiler) is not counted, as it would be in ``wait4``'s rusage. Not ``ru_maxrss``: Linux carries
    it across ``execve``, and subprocess starts this process by vfork + exec, so it would report the
    benchmark's own peak whenever that is the larger (measured: 3426 MiB for a 1666 MiB DPO run).
    """
    report = log.with_suffix(".rss.json")
    cmd = [sys.executable, __file__, "--peak_rss_to", str(report), *argv]
    start = time.perf_counter()
    with open(log, "w") as out:
        returncode = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    check=False).returncode
    wall_s = time.perf_counter() - start
    peak = json.loads(report.read_text())["peak_rss_mb"] if report.exists() else float("nan")
    return Measured(returncode, peak, wall_s, log)


def _run_and_record_peak_rss(argv: list[str]) -> int:
    """``harness.py --peak_rss_to FILE (-m MODULE | SCRIPT) ARGS...``: run the target in this process as
    ``__main__``, then write this process's peak RSS in MiB to FILE."""
    report, target = Path(argv[1]), argv[2:]
    code = 1
    try:
        if target[0] == "-m":
            sys.argv = target[1:]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = target
            runpy.run_path(target[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        peak_mb = _peak_rss_mb()
        report.write_text(json.dumps({"peak_rss_mb": peak_mb, "returncode": code}))
    return code


def _peak_rss_mb() -> float:
    """This address space's peak resident memory (``VmHWM``); ``ru_maxrss`` where /proc is missing."""
    memory = process_memory_mb()
    if memory is not None:
        return memory["VmHWM"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------- a process tree's memory, sampled


def process_memory_mb(pid: int | str = "self") -> dict | None:
    """``{"VmRSS": now, "VmHWM": peak so far}`` of a process in MiB, from /proc; None once it has ended."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    if "VmRSS" not in fields:  # a zombie
        return None
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}  # kB


class TreeSampler:
    """Every ``interval`` s, while it runs: the resident memory of ``root`` and all its descendants.

    ``processes``: pid -> {name, peak_mb}, a process's peak the larger of its sampled ``VmRSS`` and its own
    ``VmHWM`` (so a peak between two samples counts). ``peak_sum_mb``: the peak of the processes' summed
    ``VmRSS``, or with ``pss`` of their summed PSS (``smaps_rollup``: a shared page, such as Ray's object store
    or a library, split among the processes that map it, so the sum is the memory the run really holds; slower
    to read, hence a longer interval there).
    """

    def __init__(self, root: int, interval: float = 0.1, pss: bool = False):
        self.root, self.interval, self.pss = root, interval, pss
        self.processes: dict[int, dict] = {}
        self.peak_sum_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def largest_mb(self) -> float:
        """The peak of the largest process so far."""
        return max((entry["peak_mb"] for entry in self.processes.values()), default=0.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0.0
            for pid in _descendants(self.root):
                memory = process_memory_mb(pid)
                if memory is None:
                    continue
                total += _pss_mb(pid) if self.pss else memory["VmRSS"]
                entry = self.processes.setdefault(pid, {"name": _process_name(pid), "peak_mb": 0.0})
                entry["peak_mb"] = max(entry["peak_mb"], memory["VmHWM"], memory["VmRSS"])
                if entry["name"].startswith(("ray::IDLE", "python")):  # a Ray worker names itself when it starts
                    entry["name"] = _process_name(pid)
            self.peak_sum_mb = max(self.peak_sum_mb, total)
            self._stop.wait(self.interval)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _pss_mb(pid: int) -> float:
    """A process's PSS in MiB (/proc/<pid>/smaps_rollup); 0 for one that has ended."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return 0.0


def _process_name(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in words if w]
    if words and words[0].startswith("ray::"):
        return words[0].split(".")[0]  # ray::_Rank.node: the actor, then the method it runs
    return " ".join(Path(w).name if i < 2 else w for i, w in enumerate(words[:4]))


def check_run(measured: Measured, what: str) -> None:
    if measured.returncode != 0:
        tail = measured.log.read_text()[-3000:]
        raise RuntimeError(f"{what} exited with {measured.returncode}; log {measured.log}:\n{tail}")


def run_trl_worker(script: str, spec: dict, run_dir: Path, env: dict, what: str) -> dict:
    """``python SCRIPT --trl_worker RUN_DIR/spec.json`` in a fresh measured process, ``spec`` written there with
    ``out`` = RUN_DIR; the report the worker writes to RUN_DIR/steps.json (its ``steps`` and what else it
    records), with the process's ``peak_rss_mb`` and ``wall_s``. ``what`` names the worker in an error."""
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(run_dir)}))
    measured = run_measured([script, "--trl_worker", str(spec_path)], run_dir.with_suffix(".log"), env)
    check_run(measured, what)
    report = json.loads((run_dir / "steps.json").read_text())
    return {**report, "peak_rss_mb": measured.peak_rss_mb, "wall_s": measured.wall_s}


def record_trl_steps(trainer, describe_micro_batch) -> list[dict]:
    """Attach to a TRL trainer; the returned list gets one entry per optimizer step as it trains.

    Each entry holds ``micro_batches`` (``describe_micro_batch(inputs, num_items_in_batch)`` plus
    the loss ``compute_loss`` returned, for every micro-batch of the step) and
    ``step_time_s``: the wall time from the end of the previous step (or the
    start of training) to the end of this one, so it includes TRL's
    collation, as openpack's ``step_time_s`` includes its planning and collation.
    """
    from transformers import TrainerCallback

    steps, pending, clock = [], [], {}
    original = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        result = original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        loss = result[0] if return_outputs else result
        pending.append({**describe_micro_batch(inputs, num_items_in_batch), "loss": loss.item()})
        return result

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["last"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            steps.append({"micro_batches": list(pending), "step_time_s": now - clock["last"]})
            pending.clear()
            clock["last"] = now

    trainer.compute_loss = compute_loss
    trainer.add_callback(StepTimer())
    return steps


def shell_command(cmd: list[str]) -> str:
    """``-m openpack.cli.main X ...`` shown as the ``openpack X ...`` command it is."""
    words = [str(w) for w in cmd]
    if words[:2] == ["-m", "openpack.cli.main"]:
        words = ["openpack"] + words[2:]
    return " ".join(words)


def run_interleaved(arms: dict, repeats: int) -> list[dict]:
    """Call ``arms[name](repeat) -> result`` for every arm in turn, ``repeats`` times (A B A B ...).

    Each result gets its arm, repeat and steady-state throughput added, and a progress line is printed.
    """
    runs = []
    for repeat in range(repeats):
        for arm, run in arms.items():
            result = run(repeat)
            result.update(arm=arm, repeat=repeat, **steady_state(result["steps"]))
            runs.append(result)
            print(f"  {arm:12s} repeat {repeat}: {result['tokens_per_s']:.0f} real tokens/s, "
                  f"{result['step_time_s']:.2f} s/step, peak RSS {result['peak_rss_mb']:.0f} MiB, "
                  f"step-1 loss {result['steps'][0]['loss']:.6f}, run {result['wall_s']:.0f} s", flush=True)
    return runs


def by_arm(runs: list[dict], key: str) -> dict[str, list[float]]:
    """``{arm: [value of each repeat]}`` for one result key."""
    values: dict[str, list[float]] = {}
    for run in runs:
        values.setdefault(run["arm"], []).append(run[key])
    return values


def steady_state(steps: list[dict]) -> dict:
    """Throughput over the steps after the first (warm-up: allocator, thread pools, lazy init).

    ``steps``: dicts with tokens, step_time_s and, when known, pairs or samples.
    """
    measured = steps[1:] if len(steps) > 1 else steps
    seconds = sum(s["step_time_s"] for s in measured)
    result = {"tokens_per_s": sum(s["tokens"] for s in measured) / seconds,
              "step_time_s": seconds / len(measured), "measured_steps": len(measured)}
    for key in ("pairs", "samples"):
        if key in measured[0]:
            result[f"{key}_per_s"] = sum(s[key] for s in measured) / seconds
    return result


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def fmt_spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """``median (min-max)``, or just the value for a single repeat."""
    low, mid, high = spread(values)
    if len(values) == 1:
        return fmt.format(mid)
    return f"{fmt.format(mid)} ({fmt.format(low)}-{fmt.format(high)})"


def machine_description() -> str:
    cpu = platform.processor() or "CPU"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = ", ".join(f"{name} {_version(name)}" for name in LIBRARIES)
    return f"{os.cpu_count()}-core CPU ({cpu}), no GPU; run on {datetime.date.today().isoformat()} with {versions}"


def code_description() -> str:
    """``openpack at commit abc1234``, saying so when openpack/ differs from that commit; or why it is unknown."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "openpack"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "openpack from a folder outside git (commit unknown)"
    return f"openpack at commit {commit}" + (" with uncommitted changes in openpack/" if changed else "")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def add_run_args(parser, section: str, learning_rate: float) -> None:
    """The flags dpo_vs_trl and sft_vs_trl share: run length, model shape, machine, outputs."""
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, interleaved")
    parser.add_argument("--scale", type=int, default=4, help="divide every length of the ANCHORS mix by this")
    parser.add_argument("--vocab", type=int, default=32000, help="model vocab (the tokenizer uses 46 ids)")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--intermediate", type=int, default=768, help="MLP width")
    parser.add_argument("--learning_rate", type=float, default=learning_rate, help="constant learning rate")
    parser.add_argument("--seed", type=int, default=0, help="data and step-order seed")
    add_output_args(parser, section, chart="tokens/s and peak memory")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, vocab and data, 2 steps, 1 repeat; docs only to a --markdown file")
    parser.add_argument("--trl_worker", type=Path, default=None, help=argparse.SUPPRESS)


def add_output_args(parser, section: str, chart: str | None) -> None:
    """The flags of every benchmark that runs in a work folder and writes a docs section: --threads, --out,
    --markdown and, where it draws one (``chart``: of what), --chart."""
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of every run")
    parser.add_argument("--out", type=Path, default=None,
                        help="work folder to keep (what the runs wrote, logs, results.json); default: a temporary one")
    parser.add_argument("--markdown", default=None,
                        help=f"file whose {section} section to regenerate (default docs/benchmarks.md; none: skip)")
    if chart is not None:
        parser.add_argument("--chart", type=Path, default=None,
                            help=f"PNG chart of {chart} (default: img/{section}.png beside --markdown)")


def given_flags(argv=None) -> str:
    """The flags a benchmark was run with, for the command its docs section shows (``--out DIR`` left out: a
    work folder of this machine)."""
    given = sys.argv[1:] if argv is None else list(argv)
    return " ".join(w for i, w in enumerate(given) if w != "--out" and (i == 0 or given[i - 1] != "--out"))


def apply_smoke(args) -> None:
    """--smoke: a tiny model and data, 2 steps, 1 repeat."""
    args.steps, args.repeats, args.scale = 2, 1, 16
    args.vocab, args.hidden, args.layers, args.intermediate = 512, 32, 2, 64


def docs_outputs(markdown: str | None, chart: Path | None, name: str, smoke: bool) -> tuple[Path | None, Path | None]:
    """Where a benchmark writes its docs section and chart: docs/benchmarks.md and docs/img/NAME.png by
    default; nowhere for ``--markdown none``, or under ``--smoke`` (CI never touches docs/) unless a file is named."""
    if markdown == "none" or (smoke and markdown is None):
        return None, None
    markdown = Path(markdown) if markdown else REPO / "docs" / "benchmarks.md"
    return markdown, chart or markdown.parent / "img" / f"{name}.png"


def write_section(doc: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` (appended if missing).

    Everything outside the markers, other benchmarks' sections included, is kept as it is.
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


@dataclass
class Panel:
    """One bar chart: ``series[name][i]`` are the repeats of group ``groups[i]`` (bar = median, whiskers = range)."""

    title: str
    ylabel: str
    groups: list[str]
    series: dict[str, list[list[float]]]
    label_format: str = "%.0f"  # of the value printed on each bar


def save_bar_charts(path: Path, panels: list[Panel], title: str) -> None:
    # no pyplot: no global backend, no display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(panels), 4), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), index + 1)
        width = 0.8 / len(panel.series)
        for k, (name, repeats) in enumerate(panel.series.items()):
            x = np.arange(len(panel.groups)) + (k - (len(panel.series) - 1) / 2) * width
            mids = [spread(r)[1] if r else 0.0 for r in repeats]
            errors = [[m - spread(r)[0] if r else 0 for r, m in zip(repeats, mids)],
                      [spread(r)[2] - m if r else 0 for r, m in zip(repeats, mids)]]
            bars = ax.bar(x, mids, width, yerr=errors, capsize=3, label=name)
            ax.bar_label(bars, fmt=panel.label_format, fontsize=7, padding=2)
        ax.set_xticks(np.arange(len(panel.groups)), panel.groups)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


if __name__ == "__main__" and sys.argv[1:2] == ["--peak_rss_to"]:
    sys.exit(_run_and_record_peak_rss(sys.argv[1:]))


def speed_and_memory_charts(path: Path, summary: dict, arms, workload: str, title: str) -> None:
    """The two panels every framework comparison draws: real tokens/s and peak resident memory per arm."""
    save_bar_charts(path, [
        Panel("real tokens / s (higher is better)", "tokens / s", [workload],
              {arm: [summary["tokens_per_s"][arm]] for arm in arms}),
        Panel("peak resident memory (lower is better)", "GiB", [workload],
              {arm: [[v / 1024 for v in summary["peak_rss_mb"][arm]]] for arm in arms}, "%.1f"),
    ], title)


def run_in_work_folder(args, benchmark, trl_worker, prefix: str) -> int:
    """A benchmark's entry: ``trl_worker`` when --trl_worker asks for it, else ``benchmark(args, work)`` in --out
    or a temporary folder (``trl_worker`` None: a benchmark with no TRL worker)."""
    if trl_worker is not None and args.trl_worker is not None:
        return trl_worker(args.trl_worker)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        return benchmark(args, args.out)
    with tempfile.TemporaryDirectory(prefix=prefix) as work:  # ~1 GB of models and checkpoints
        return benchmark(args, Path(work))
