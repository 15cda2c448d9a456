"""Every GPU check of docs/verification.md in one command: results under --out, a Markdown block to append.

    # here, once: the wheels the GPU machine lacks (DeepSpeed, pydantic, hjson, datasets, TRL) into .whl/
    bash examples/gpu_wheels.sh
    # a lent GPU machine, in ONE call of the device tool (carry [".whl"]), from the repo root:
    python examples/gpu_runbook.py --out "$OUT"
    # then, here: append the block that came back to docs/verification.md
    cat <files_at>/verification_block.md >> docs/verification.md
    # this CPU machine: check the script and run its CPU parts on tiny models (the full trainer: about 4 min)
    python examples/gpu_runbook.py --dry-run --out /tmp/runbook

The GPU machine has torch, transformers, triton, peft and pytest but no DeepSpeed, Ray, datasets, flash-attn or
vLLM. The runbook installs the carried wheels of ``.whl/`` at its start (``--wheels``); Ray and vLLM are too large
to carry, so the full trainer runs ``--launcher local`` with HF rollouts.

Sections, in the order they run (by value), each recorded whatever the others did (a failure is a result);
``--sections`` picks some:

1. ``full_trainer``: every ``openpack train_*`` command through the CLI with DeepSpeed, in bf16, on a
   Qwen2.5-0.5B shape (``examples/gpu_full_trainer.py``: tokens/s, MFU, peak memory, the step-1 loss against fp32
   on the CPU, checkpoint and resume), then the trainer's DPO tokens/s against ``benchmarks/gpu_mfu.py``'s packed
   arm and TRL's DPOTrainer; ``--commands`` picks some commands, ``--profile`` adds the DPO step's op table;
2. ``pytest tests/gpu``: packed == unpacked per CUDA backend and dtype, the reward model in bf16, and the CUDA
   sync counter (syncs per SFT/DPO/RM step with 1 and 4 micro-batches, printed by file and line);
3. ``openpack check_packing --dtype bfloat16`` (auto backend) and with ``--attn_backend torch_varlen``;
4. prefix-sharing equality: the ``test_prefix_sharing*`` modules, and whether any of them checks bf16;
5. MFU: ``benchmarks/gpu_mfu.py`` (packed vs padded, the 0.5B shape; ``--mfu_sizes 0.5b 1.5b`` for both);
6. ``--fused_loss``: the LM head alone, chunked vs fused, bf16, 8192 tokens at width 896, vocab 32000 and
   151936 (``benchmarks/fused_loss.py --head_only``);
7. RL ``--prefix_sharing``: one training-side pass over a long-prompt rollout batch (16 prompts of 384 tokens x 8
   completions of 16-64), shared vs unshared, on the 0.5B shape in bf16 (``benchmarks/rl_prefix_sharing.py``);
8. DPO tokens/s of openpack's packed step without DeepSpeed vs TRL's DPOTrainer, in-process;
9. ``--ring_attn_size``'s split code path on the one GPU (``benchmarks/context_parallel.py``): a split row's
   log-probs and gradients against the whole row as a single-rank group (NCCL) and as 2 ranks sharing the GPU
   (gloo), the first run of flash-attn's / torch varlen's bottom-right call; then one long row's memory per rank.

Only three files come back (the device returns at most 8): ``verification_block.md``, ``runbook.log`` (every
command's output, each line stamped with the seconds since its command started) and ``results.json``. No section
or command starts after ``--budget_s``, and a command still running ``GRACE_S`` after it is stopped, so the call
ends inside 9 minutes; at the costs of 2026-11-27 the full trainer alone needs about 15 minutes on an H200, so a
second call runs the commands the first did not reach (``--commands``).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import context_parallel as cp_bench  # noqa: E402  (benchmarks/)
import gpu_full_trainer as ft  # noqa: E402  (beside this file)

GRACE_S = 40.0  # a command still running this long after --budget_s is stopped


class Runbook:
    """Sections run in order; each adds Markdown lines, and its command output goes to runbook.log."""

    def __init__(self, out: Path, dry_run: bool, budget_s: float):
        self.out, self.dry_run, self.budget_s, self.start = out, dry_run, budget_s, time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "runbook.log", "w", encoding="utf-8")
        self.lines: list[str] = []
        self.results: dict[str, object] = {}

    def spent(self) -> float:
        return time.monotonic() - self.start

    def command(self, name: str, argv: list[str], timeout_s: float) -> tuple[int, str]:
        """Run ``argv`` from the repo root; its output goes to the log and is returned. It is stopped at
        ``timeout_s`` or ``GRACE_S`` past the budget, whichever comes first, so the call ends in time."""
        timeout_s = max(1.0, min(timeout_s, self.budget_s + GRACE_S - self.spent()))
        self.log.write(f"\n===== {name}: {' '.join(argv)}\n")
        self.log.flush()
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "PYTHONUNBUFFERED": "1"}
        # The output streams into the log, so a call cut off by the device's limit still brings back what a
        # command printed so far (on 2026-11-26 gpu_mfu's per-arm lines were lost that way). Each line carries the
        # seconds since the command started: where a command's time goes (imports, loading, steps, saving).
        began, timed_out = time.monotonic(), threading.Event()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
        timer = threading.Timer(timeout_s, stop, (proc, timed_out))
        timer.start()
        lines = []
        for line in proc.stdout:
            self.log.write(f"[{time.monotonic() - began:6.1f}s] {line}")
            self.log.flush()
            lines.append(line)
        code = proc.wait()
        timer.cancel()
        if timed_out.is_set():
            code = 124
            self.log.write(f"\ntimed out after {timeout_s:.0f} s\n")
        self.log.write(f"\n===== {name}: exit {code} ({time.monotonic() - began:.0f} s)\n")
        self.log.flush()
        return code, "".join(lines)

    def section(self, title: str, run) -> None:
        spent = time.monotonic() - self.start
        if spent > self.budget_s:
            self.lines += [f"### {title}", "", f"Skipped: the budget of {self.budget_s:.0f} s was spent "
                           f"({spent:.0f} s).", ""]
            return
        began = time.monotonic()
        try:
            body = run()
        except Exception as err:  # a broken section is a result too; the next one still runs
            body = [f"Failed: `{type(err).__name__}: {err}` (traceback in runbook.log)."]
            import traceback

            self.log.write(traceback.format_exc())
        self.lines += [f"### {title}", "", *body, "", f"({time.monotonic() - began:.0f} s)", ""]
        self.write()

    def write(self) -> None:
        (self.out / "verification_block.md").write_text("\n".join(self.header() + self.lines) + "\n")
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def header(self) -> list[str]:
        import torch
        import transformers

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU dry run)"
        kind = "dry run on CPU (tiny models; checks the runbook, measures nothing)" if self.dry_run else "GPU run"
        return [f"## GPU runbook: {device}, {datetime.date.today()} (`examples/gpu_runbook.py`)", "",
                f"{kind}; torch {torch.__version__}, transformers {transformers.__version__}, Python "
                f"{sys.version.split()[0]}, commit {git_commit()}.", ""]


def stop(proc: subprocess.Popen, flag: threading.Event) -> None:
    """Kill a command that outran its time, with every process it started (its own session)."""
    flag.set()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended as the timer fired
        pass


def install_wheels(folder: Path) -> None:
    """``pip install --no-index --no-deps --target`` the carried wheels (DeepSpeed, pydantic, hjson, datasets,
    TRL: the GPU machine lacks them) into a fresh folder, first on this process's path and every command's."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return
    site = Path(tempfile.mkdtemp(prefix="openpack_wheels_"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(site), *wheels], check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    print(f"gpu_runbook: installed {len(wheels)} wheels from {folder} into {site}", flush=True)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def pytest_summary(output: str) -> str:
    """pytest's last line (``3 passed, 2 skipped in 4.1s``)."""
    tail = [line.strip("= ") for line in output.splitlines() if " in " in line and (
        "passed" in line or "failed" in line or "skipped" in line or "error" in line)]
    return tail[-1] if tail else "no pytest summary (see runbook.log)"


def full_trainer(book: Runbook, size: str, scale: int, dpo_steps: int, only: list[str] | None,
                 profile: bool = False, no_resume: list[str] | None = None) -> list[str]:
    """Every command through the CLI with DeepSpeed (``gpu_full_trainer.py``), then the trainer's packed DPO
    against the kernel-level harness (``benchmarks/gpu_mfu.py``'s packed arm) and TRL's DPOTrainer on the same
    model shape, length mix, 64 pairs a step and row cap."""
    import torch

    import gpu_mfu

    gpu = torch.cuda.is_available() and not book.dry_run
    device = torch.device("cuda" if gpu else "cpu")
    work = Path(tempfile.mkdtemp(prefix="openpack_full_trainer_"))
    try:
        setup = ft.prepare(work, size, scale, gpu)
        peak = gpu_mfu.matmul_peak(device, torch.bfloat16)
        if gpu:
            torch.cuda.empty_cache()
        every = ft.commands(setup)
        cmds = ft.selected(every, only)
        # the fp32 CPU runs use the cores the GPU runs leave free (a GPU run keeps about two busy)
        references = ft.CpuReferences(setup, threads=max(1, (os.cpu_count() or 2) - 4))
        references.start(every, cmds)
        results, overhead, resumed, profiled = [], [], set(), []
        for command in cmds:
            if book.spent() > book.budget_s:
                results.append(ft.Result(command.name, command.argv, note=f"skipped: the budget of "
                                         f"{book.budget_s:.0f} s was spent"))
                continue
            # a dry run resumes one command of each checkpoint kind (CI's time); a GPU run resumes every one
            resume = (not book.dry_run or command.checkpoint not in resumed) and command.name not in (no_resume or [])
            resumed.add(command.checkpoint)
            results.append(ft.run_command(book, setup, command, peak, resume))
            book.results.setdefault("full_trainer", []).append(  # step 1's metrics, all of them; the rest's time
                {**{k: v for k, v in vars(results[-1]).items() if k != "metrics"}, "step1": results[-1].metrics[:1],
                 "step_time_s": [m["step_time_s"] for m in results[-1].metrics]})
            book.write()  # results.json so far: a call cut off by the device's limit still brings them back
            if command.name == "dpo":
                overhead = dpo_overhead(book, results[-1], size, scale, dpo_steps, device, work)
                if gpu:  # what the in-process arms cached goes back before the next command starts
                    torch.cuda.empty_cache()
                if profile:
                    profiled = profile_step(book, command, work / "runs" / "dpo_profile")
        finished = references.wait(book.budget_s + GRACE_S - book.spent())
        book.log.write("".join(references.log))
        book.results["full_trainer_cpu_step1"] = references.step1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shape = f"Qwen2.5-{size.upper()}" if size != "smoke" else "tiny Qwen2"
    lines = [f"Every command through `python -m openpack.cli.main` (the `openpack` entry point) with "
             f"`--launcher local --bf16`, ZeRO-2 (the default) unless the command says, on {shape}-shaped models "
             "from a config (random init; the DPO reference another seed), SFT/DPO/RM rows from the ANCHORS mix"
             + (f" divided by {scale}" if scale > 1 else "") + ", GRPO/PPO on two-digit additions with HF "
             "rollouts. tokens/s: real tokens over the steps after the first (RL: the training phase's). MFU: "
             "model FLOPs (matmuls, tied head, causal attention; passes counted as useful: SFT/RM 3, DPO 4 with "
             "its reference, LoRA 2, RL's training phase 3) / time / the measured bf16 matmul peak "
             f"({peak:.0f} TFLOP/s). Peak memory: NVML, the GPU's memory in use above what it was before the "
             "command. Step-1 loss tolerance: 1% of the fp32 loss (0.01 at least). Resume: a second run with "
             "`--load_checkpoint` and one more step.", "", *ft.table(results, cmds, references)]
    if not finished:
        lines += ["", "The fp32 CPU runs had not all finished when the budget was spent."]
    lines += ["", *overhead, *profiled, "", "Online RL:", "", *ft.rl_lines(results), "", "Commands:", "",
              *ft.describe_commands(results, work), "", "`$WORK`: a temporary folder, removed at the end."]
    return lines


def profile_step(book: Runbook, command, save: Path) -> list[str]:
    """``command``'s second step under torch.profiler (``examples/profile_step.py``): its top ops, in the block."""
    argv = [sys.executable, "examples/profile_step.py", "--step", "2", "--rows", "12", *command.argv, "--max_steps",
            "2", "--save_path", str(save)]
    code, output = book.command(f"profile: {command.name} step 2", argv, 300)
    shutil.rmtree(save, ignore_errors=True)
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("profile_step:")), None)
    if code != 0 or start is None:
        return ["", f"Profile of `{command.name}`'s step 2: exit {code}, no table (runbook.log)."]
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("step ")), len(lines))
    table = lines[start:end][:40]  # the report: from its first line to the trainer's next progress line
    return ["", f"`{command.name}`'s step 2 under torch.profiler (`examples/profile_step.py`; the whole output is in "
            "runbook.log):", "", "```", *table, "```"]


def dpo_overhead(book: Runbook, trainer, size: str, scale: int, steps: int, device, work: Path) -> list[str]:
    """The trainer's DPO tokens/s against the kernel-level harness and TRL: the trainer's own overhead."""
    import torch

    import gpu_mfu

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pairs = ft.dpo_pairs_per_step(scale)
    args = argparse.Namespace(steps=steps, pairs_per_step=pairs, max_tokens=16384 // scale, scale=scale, seed=0,
                              gradient_checkpointing=False, attn_backend="torch_varlen")
    gpu_mfu.set_attention_backend(args.attn_backend if device.type == "cuda" else "sdpa")
    harness = gpu_mfu.run_arm(size, True, args, device, dtype, peak=0.0)
    rows = [("openpack train_dpo (the full trainer: DeepSpeed ZeRO-2, CLI, data pipeline)", trainer.tokens_per_s),
            ("benchmarks/gpu_mfu.py packed arm (the same kernels; torch AdamW, no DeepSpeed)",
             None if harness.get("oom") else harness["tokens_per_s"])]
    try:
        import datasets  # noqa: F401
        import trl

        theirs = trl_arm(size, steps, pairs, scale, device, dtype, work / "trl")
        rows.append((f"TRL {trl.__version__} DPOTrainer (8 pairs per micro-batch, padded)", theirs["tokens_per_s"]))
    except ImportError as err:
        rows.append((f"TRL: not run ({err}; carry its wheels: examples/gpu_wheels.sh)", None))
    book.results["dpo_overhead"] = dict(rows)
    lines = [f"DPO real tokens/s, {pairs} pairs a step, rows <= {16384 // scale} tokens, the same length mix:", "",
             "| arm | real tokens/s | full trainer / arm |", "|---|---:|---:|"]
    for name, rate in rows:
        ratio = f"{trainer.tokens_per_s / rate:.2f}x" if rate and trainer.tokens_per_s else ""
        lines.append(f"| {name} | {'' if rate is None else format(rate, '.0f')} | {ratio} |")
    return lines


def gpu_tests(book: Runbook) -> list[str]:
    code, output = book.command("tests/gpu", [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-s", "-rs", "-p",
                                              "no:cacheprovider"], 300)
    book.results["gpu_tests"] = {"exit": code, "summary": pytest_summary(output)}
    syncs = [line for line in output.splitlines() if " micro-batches: " in line and "syncs" in line]
    lines = [f"`python -m pytest tests/gpu -q -s`: **{pytest_summary(output)}** (exit {code})."]
    if syncs:
        lines += ["", "CUDA syncs per step (`tests/gpu/test_step_syncs_cuda.py`, second step; every sync by file "
                  "and line is in runbook.log):", "", *[f"- {line.strip()}" for line in syncs]]
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    if skipped:
        lines += ["", f"{len(skipped)} skip lines, e.g. `{skipped[0][:160]}`"]
    return lines


def check_packing(book: Runbook) -> list[str]:
    lines = []
    device = "cuda" if not book.dry_run else "cpu"
    for extra in ([], ["--attn_backend", "torch_varlen"]) if not book.dry_run else ([],):
        argv = [sys.executable, "-m", "openpack.cli.main", "check_packing", "--device", device, "--dtype",
                "bfloat16", *extra]
        code, output = book.command("check_packing", argv, 180)
        rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        verdict = next((line for line in output.splitlines() if line.startswith("packed attention on")), "no verdict")
        book.results.setdefault("check_packing", []).append({"argv": argv[3:], "exit": code, "rows": rows})
        lines.append(f"- `openpack {' '.join(argv[3:])}`: {verdict} (exit {code})")
        for r in rows:
            errors = {k: v for k, v in r.items() if isinstance(v, float)}
            shown = ", ".join(f"{k} {v:.3g}" for k, v in errors.items())
            lines.append(f"  - {r.get('arch')} ({r.get('backend')}): {shown}")
    return lines


def prefix_sharing(book: Runbook) -> list[str]:
    modules = sorted(glob.glob(str(ROOT / "tests" / "**" / "test_prefix_sharing*.py"), recursive=True))
    if not modules:
        book.results["prefix_sharing"] = "not landed"
        return ["Skipped: `--prefix_sharing` has not landed (no `tests/**/test_prefix_sharing*.py` in this tree)."]
    rel = [str(Path(m).relative_to(ROOT)) for m in modules]
    code, output = book.command("prefix_sharing", [sys.executable, "-m", "pytest", *rel, "-q", "-rs", "-p",
                                                   "no:cacheprovider"], 240)
    book.results["prefix_sharing"] = {"modules": rel, "exit": code, "summary": pytest_summary(output)}
    lines = [f"`python -m pytest {' '.join(rel)}`: **{pytest_summary(output)}** (exit {code})."]
    if not any("bfloat16" in Path(m).read_text() for m in modules):
        lines += ["", "None of these modules checks bf16 on CUDA yet: they ran as written (fp32). A bf16 CUDA "
                  "equality test of `--prefix_sharing` is still to be written (tests/gpu)."]
    return lines


def dpo_vs_trl(book: Runbook, size: str, steps: int, pairs_per_step: int, scale: int) -> list[str]:
    """openpack's packed DPO step vs TRL's DPOTrainer, in this process, on one model shape and one length mix."""
    import torch

    import gpu_mfu

    device = torch.device("cuda" if torch.cuda.is_available() and not book.dry_run else "cpu")
    args = argparse.Namespace(steps=steps, pairs_per_step=pairs_per_step, max_tokens=16384 // scale, scale=scale,
                              seed=0, gradient_checkpointing=False, attn_backend="torch_varlen")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu_mfu.set_attention_backend(args.attn_backend if device.type == "cuda" else "sdpa")
    ours = gpu_mfu.run_arm(size, True, args, device, dtype, peak=0.0)
    book.results.setdefault("dpo_vs_trl", []).append({"arm": "openpack", **ours})
    lines = [f"Qwen2.5-{size.upper()}-shaped model from a config (random init, {str(dtype)[6:]}), "
             f"{pairs_per_step} pairs per optimizer step from the ANCHORS mix"
             + (f" divided by {scale}" if scale > 1 else "") + f", {steps} steps (the first not counted), sigmoid "
             "loss, frozen reference of the same shape.", "",
             "| arm | real tokens/s | pairs/s | s / step | real / computed tokens | peak memory (GiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    if ours.get("oom"):
        lines.append("| openpack (packed rows, varlen attention) | out of memory | | | | |")
    else:
        kernel = "varlen attention" if device.type == "cuda" else "SDPA per segment"
        lines.append(f"| openpack (packed rows <= {args.max_tokens} tokens, {kernel}) | "
                     f"{ours['tokens_per_s']:.0f} | {ours['pairs_per_s']:.2f} | {ours['step_s']:.3f} | "
                     f"{ours['real_share']:.1%} | {ours['peak_gib']:.1f} |")
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as err:
        lines += ["", f"TRL arm skipped: {err} (carry trl, datasets, dill and multiprocess as wheels; "
                  "docs/verification.md)."]
        return lines
    theirs = trl_arm(size, steps, pairs_per_step, scale, device, dtype, book.out / "trl")
    book.results["dpo_vs_trl"].append({"arm": "TRL", **theirs})
    lines.append(f"| TRL {trl.__version__} DPOTrainer (8 pairs per micro-batch, padded) | {theirs['tokens_per_s']:.0f} "
                 f"| {theirs['pairs_per_s']:.2f} | {theirs['step_s']:.3f} | {theirs['real_share']:.1%} | "
                 f"{theirs['peak_gib']:.1f} |")
    if not ours.get("oom"):
        lines += ["", f"openpack / TRL real tokens/s: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x."]
    return lines


def trl_arm(size: str, steps: int, pairs_per_step: int, scale: int, device, dtype, work: Path) -> dict:
    """TRL's DPOTrainer with its defaults on the same shape and length mix (text of the demo tokenizer's
    characters, one token each), timed per optimizer step by ``harness.record_trl_steps``."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    import gpu_mfu
    import harness
    from openpack.data.demo_tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    rows = harness.preference_rows(harness.scaled_lengths(pairs_per_step * steps, scale, 0), 0)
    policy = gpu_mfu.build(size, dtype, device, seed=0).train()
    reference = gpu_mfu.build(size, dtype, device, seed=0).eval()
    args = DPOConfig(output_dir=str(work), use_cpu=device.type == "cpu", bf16=dtype == torch.bfloat16,
                     report_to=[], disable_tqdm=True, save_strategy="no", max_steps=steps,
                     gradient_accumulation_steps=pairs_per_step // 8, per_device_train_batch_size=8,
                     max_length=harness.ROW_CAP // scale, learning_rate=1e-6, beta=0.1, loss_type=["sigmoid"],
                     lr_scheduler_type="constant", gradient_checkpointing=False, seed=0)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)

    def describe(inputs, _):
        mask = inputs["attention_mask"]
        return {"tokens": int(mask.sum()), "slots": mask.numel(), "pairs": mask.shape[0] // 2}

    records = harness.record_trl_steps(trainer, describe)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    rest = records[1:] or records
    step_s = statistics.median(r["step_time_s"] for r in rest)
    tokens = statistics.mean(sum(m["tokens"] for m in r["micro_batches"]) for r in rest)
    slots = sum(m["slots"] for r in records for m in r["micro_batches"])
    result = {"step_s": step_s, "tokens_per_s": tokens / step_s, "pairs_per_s": pairs_per_step / step_s,
              "real_share": sum(m["tokens"] for r in records for m in r["micro_batches"]) / slots,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")}
    del trainer, policy, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def mfu(book: Runbook, sizes: list[str]) -> list[str]:
    argv = [sys.executable, "benchmarks/gpu_mfu.py"] + (["--smoke"] if book.dry_run else ["--sizes", *sizes])
    code, output = book.command("gpu_mfu", argv, 300)
    table = output[output.find("## GPU: packed vs padded DPO"):] if "## GPU: packed" in output else ""
    book.results["gpu_mfu"] = {"exit": code}
    body = [line for line in table.splitlines()[1:] if line.strip()]
    return [f"`{' '.join(argv[1:])}` (exit {code}):", "", *body] if body else [f"`{' '.join(argv[1:])}` exit {code}: "
                                                                            "no table (see runbook.log)."]


def fused_loss(book: Runbook) -> list[str]:
    sizes = ["--head_tokens", "256", "--head_hidden", "64", "--head_vocabs", "4096"] if book.dry_run else [
        "--head_tokens", "8192", "--head_hidden", "896", "--head_vocabs", "32000,151936"]
    argv = [sys.executable, "benchmarks/fused_loss.py", "--head_only", "--device", "cpu" if book.dry_run else "cuda",
            "--dtype", "bfloat16", "--repeats", "3", *sizes]
    code, output = book.command("fused_loss", argv, 240)
    book.results["fused_loss"] = {"exit": code}
    table = [line for line in output.splitlines() if line.startswith("|")]
    return [f"`{' '.join(argv[1:])}` (exit {code}):", "", *table] if table else [
        f"`{' '.join(argv[1:])}` exit {code}: no table (see runbook.log)."]


def rl_prefix_sharing(book: Runbook) -> list[str]:
    argv = [sys.executable, "benchmarks/rl_prefix_sharing.py"] + (["--smoke"] if book.dry_run else [
        "--model", "0.5b", "--device", "cuda", "--dtype", "bfloat16", "--prompts", "16"])
    code, output = book.command("rl_prefix_sharing", argv, 180)
    book.results["rl_prefix_sharing"] = {"exit": code}
    kept = [line for line in output.splitlines() if line.startswith(("model:", "|", "prefix sharing:"))]
    return [f"`{' '.join(argv[1:])}` (exit {code}):", "", *kept] if kept else [
        f"`{' '.join(argv[1:])}` exit {code}: no table (see runbook.log)."]


def context_parallel(book: Runbook) -> list[str]:
    """``--ring_attn_size``'s split code path on this one device (``benchmarks/context_parallel.py``), since the
    session has one GPU: first ``--check``, a packed row with documents straddling the split, one longer than a
    rank's share and one starting on rank 1, each rank's part against the whole row in the same process, through
    the split code path as a single-rank group (NCCL; its pieces are whole documents, so the queries and keys of a
    call coincide) and as 2 ranks sharing the GPU (gloo, which takes CUDA tensors: NCCL refuses two ranks on one
    device), where a piece's queries are the last of its keys, the bottom-right call of flash-attn and torch varlen
    that has never run; then one long row, 1 rank against 2, for each rank's peak memory."""
    work = Path(tempfile.mkdtemp(prefix="openpack_context_parallel_"))
    device = ["--device", "cpu", "--dtype", "float32"] if book.dry_run else ["--device", "cuda", "--dtype", "bfloat16"]
    lengths = "1024" if book.dry_run else "32768,131072"
    small = ["--vocab", "512", "--hidden", "128", "--layers", "2", "--intermediate", "256"] if book.dry_run else []
    scale = 4 if book.dry_run else 64
    script = [sys.executable, "benchmarks/context_parallel.py", *device, *small, "--markdown", "none"]
    documents = ", ".join(str(n * scale) for n in cp_bench.CHECK_LENGTHS)
    lines = []
    try:
        argv = [*script, "--check", "--check_scale", str(scale), "--out", str(work / "check")]
        code, _ = book.command("context_parallel --check", argv, 240)
        results = json.loads((work / "check" / "results.json").read_text())["check"] if code == 0 else {}
        book.results["context_parallel_check"] = {"exit": code, **results}
        lines += [f"`{' '.join(argv[1:-2])}` (exit {code}): a row of documents of {documents} tokens, log-probs "
                  "and summed gradients of the split row against the whole row on the same backend.", "",
                  "| arm | tokens per rank | max log-prob error | max gradient error (largest gradient) "
                  "| whole row in this dtype vs fp32 SDPA | verdict |", "|---|---|---:|---:|---:|---|"]
        for name, r in results.items():
            if "logprob_error" not in r:
                lines.append(f"| {name} | exit {r['exit']} ({r['log']}) | | | | failed |")
                continue
            rounding = f"{r['rounding_logprob_error']:.2e}" if "rounding_logprob_error" in r else "— (fp32)"
            lines.append(f"| {name} | {r['held']} | {r['logprob_error']:.2e} | {r['grad_error']:.2e} "
                         f"({r['grad_scale']:.2e}) | {rounding} | {split_verdict(r)} |")
        argv = [*script, "--lengths", lengths, "--cap_mb", "0", "--no_balance", "--out", str(work / "memory")]
        code, _ = book.command("context_parallel memory", argv, 300)
        runs = json.loads((work / "memory" / "results.json").read_text())["runs"] if code == 0 else []
        book.results["context_parallel_memory"] = {"exit": code, "runs": [
            {k: r[k] for k in ("arm", "length", "step_mb", "peak_mb", "baseline_mb", "step_s", "loss", "grad_norm")}
            for r in runs]}
        lines += ["", f"One row of one document, a training step (`{' '.join(argv[1:-2])}`, exit {code}): step "
                  "memory per rank is its peak during the step above what it held before (torch's allocated memory on "
                  "a GPU). The 2 ranks share one device and send K/V through host memory (gloo), so their time is "
                  "not a measure of anything.", "",
                  "| row (tokens) | arm | step memory per rank (MiB) | baseline (MiB) | step (s) | loss, grad norm |",
                  "|---:|---|---:|---:|---:|---|"]
        lines += [f"| {r['length']} | {r['arm']} | {r['step_mb']:.0f} | {r['baseline_mb']:.0f} | {r['step_s']:.2f} | "
                  f"{r['loss']:.5f}, {r['grad_norm']:.5f} |" for r in runs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lines


def split_verdict(result: dict) -> str:
    """fp32: exact to 1e-5; bf16: the split row no further from the whole row than twice bf16's own rounding
    (the whole row in bf16 against fp32 SDPA), since the kernels see other block shapes."""
    rounding = result.get("rounding_logprob_error")
    if rounding is None:
        return "exact (< 1e-5)" if result["logprob_error"] < 1e-5 and result["grad_error"] < 1e-5 else "DIFFERS"
    return "within bf16 rounding" if result["logprob_error"] <= 2 * rounding else "DIFFERS"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runbook_out")),
                        help="where the block, the log and results.json go (default $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models: check the script, measure nothing")
    parser.add_argument("--append", type=Path, help="also append the block to this file (e.g. docs/verification.md)")
    parser.add_argument("--budget_s", type=float, default=480.0,
                        help=f"start no section or command after this many seconds, and stop a command "
                             f"{GRACE_S:.0f} s after it (480: the call ends inside 9 minutes on an H100)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="which sections run, in the runbook's order (default: all)")
    parser.add_argument("--commands", nargs="+", choices=ft.COMMAND_NAMES, metavar="NAME",
                        help="the full trainer's commands to run, in this order (default: all, in the runbook's "
                             "order; e.g. a rerun of those a budget cut); ppo without rm runs rm first")
    parser.add_argument("--no_resume", nargs="+", choices=ft.COMMAND_NAMES, metavar="NAME", default=[],
                        help="run these commands without the resume (one that resumed on a GPU before)")
    parser.add_argument("--profile", action="store_true",
                        help="the full trainer's DPO step 2 under torch.profiler too (one more launch, ~1 minute)")
    parser.add_argument("--trl_size", default="0.5b", choices=["0.5b", "1.5b"])
    parser.add_argument("--mfu_sizes", nargs="+", default=["0.5b"], choices=["0.5b", "1.5b"],
                        help="gpu_mfu's model shapes (0.5b and 1.5b together outran a 540 s call on 2026-11-26)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                        help="install the wheels in this folder first (examples/gpu_wheels.sh makes them; not in a "
                             "dry run)")
    args = parser.parse_args(argv)
    import harness

    # One process on one device: a process group its caller set up (a test that trained in-process: its
    # MASTER_PORT is in use) is not the runbook's, and TRL's arm and every command would try to join it.
    for name in harness.RENDEZVOUS_VARS:
        os.environ.pop(name, None)
    if not args.dry_run and args.wheels.is_dir():
        install_wheels(args.wheels)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_runbook: no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    book = Runbook(args.out, args.dry_run, args.budget_s)
    size, scale, steps = ("smoke", 8, 2) if args.dry_run else ("0.5b", 1, 5)
    trl_settings = ("smoke", 2, 8, 16) if args.dry_run else (args.trl_size, 5, 32, 1)
    runs = {
        "full_trainer": lambda: full_trainer(book, size, scale, steps, args.commands, args.profile,
                                             args.no_resume),
        "gpu_tests": lambda: gpu_tests(book),
        "check_packing": lambda: check_packing(book),
        "prefix_sharing": lambda: prefix_sharing(book),
        "mfu": lambda: mfu(book, args.mfu_sizes),
        "fused_loss": lambda: fused_loss(book),
        "rl_prefix_sharing": lambda: rl_prefix_sharing(book),
        "dpo_vs_trl": lambda: dpo_vs_trl(book, *trl_settings),
        "context_parallel": lambda: context_parallel(book),
    }
    for name in SECTIONS:
        if name in args.sections:
            book.section(SECTIONS[name], runs[name])
    book.write()
    block = (args.out / "verification_block.md").read_text()
    print(block)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + block)
    return 0


# In the order they run: by value, the full trainer first (it has never run on a GPU), then what has run once.
SECTIONS = {
    "full_trainer": "The full trainer: every command through the CLI with DeepSpeed",
    "gpu_tests": "GPU tests (packed == unpacked; CUDA syncs per step)",
    "check_packing": "check_packing in bf16",
    "prefix_sharing": "Prefix sharing == two sequences",
    "mfu": "MFU: packed vs padded DPO (benchmarks/gpu_mfu.py)",
    "fused_loss": "Fused LM head + loss vs chunked (benchmarks/fused_loss.py --head_only)",
    "rl_prefix_sharing": "RL prefix sharing: one training-side pass (benchmarks/rl_prefix_sharing.py)",
    "dpo_vs_trl": "DPO tokens/s: openpack's kernels vs TRL (without DeepSpeed)",
    "context_parallel": "Context parallelism on one GPU: the split code path vs the whole row (--ring_attn_size)",
}


if __name__ == "__main__":
    sys.exit(main())
