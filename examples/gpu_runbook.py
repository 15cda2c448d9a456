"""Every GPU check of docs/verification.md in one command: results under --out, a Markdown block to append.

    # a lent GPU machine, in ONE call of the device tool, from the repo root (about 5 min on an H200):
    python examples/gpu_runbook.py --out "$OUT"
    # then, here: append the block that came back to docs/verification.md
    cat <files_at>/verification_block.md >> docs/verification.md
    # this CPU machine: check the script and run its CPU parts on tiny models (about 2 min)
    python examples/gpu_runbook.py --dry-run --out /tmp/runbook

The GPU machine has torch, transformers, triton, peft and pytest but no
DeepSpeed, Ray, datasets, flash-attn or vLLM, so every part runs without
them: the GPU tests, ``check_packing`` and the benchmarks call openpack's
parts directly. TRL's DPOTrainer needs ``trl`` and ``datasets`` (and
``dill``, ``multiprocess``); carry them as wheels (see docs/verification.md)
or its arm is skipped with a line that says so.

Sections, each recorded whatever the others did (a failure is a result):

1. ``pytest tests/gpu``: packed == unpacked per CUDA backend and dtype, and
   the CUDA sync counter (syncs per SFT/DPO/RM step with 1 and 4
   micro-batches, printed by file and line);
2. ``openpack check_packing --dtype bfloat16`` (auto backend) and with
   ``--attn_backend torch_varlen``;
3. prefix-sharing equality: the ``test_prefix_sharing*`` modules, if
   ``--prefix_sharing`` has landed (else a line says it has not), and
   whether any of them checks bf16 (a line says so when none does);
4. DPO tokens/s, openpack (packed rows, varlen attention) vs TRL's
   DPOTrainer (its defaults: 8 pairs per micro-batch, padded), on a
   Qwen2.5-0.5B-shaped model built from a config (random init, bf16), pairs
   from the ANCHORS length mix;
5. MFU: ``benchmarks/gpu_mfu.py`` (packed vs padded, the 0.5B shape; ``--mfu_sizes 0.5b 1.5b`` for both);
6. ``--fused_loss``: the LM head alone, chunked vs fused, bf16, 8192 tokens at width 896, vocab 32000 and
   151936 (``benchmarks/fused_loss.py --head_only``): kept as an option because it wins on CPU; this says
   whether it does on a GPU;
7. RL ``--prefix_sharing``: one training-side pass (forward + backward of the token log-probs) over a long-prompt
   rollout batch (16 prompts of 384 tokens x 8 completions of 16-64), shared vs unshared, on the 0.5B shape in
   bf16 (``benchmarks/rl_prefix_sharing.py --model 0.5b --prompts 16``; 4 prompts are host-bound on an H100).

Only three files come back (the device returns at most 8): ``verification_block.md``, ``runbook.log`` (every
command's output) and ``results.json``. A section that would start after ``--budget_s`` is skipped, with a line
that says so, so the call ends inside the device's 10-minute limit.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class Runbook:
    """Sections run in order; each adds Markdown lines, and its command output goes to runbook.log."""

    def __init__(self, out: Path, dry_run: bool, budget_s: float):
        self.out, self.dry_run, self.budget_s, self.start = out, dry_run, budget_s, time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "runbook.log", "w", encoding="utf-8")
        self.lines: list[str] = []
        self.results: dict[str, object] = {}

    def command(self, name: str, argv: list[str], timeout_s: float) -> tuple[int, str]:
        """Run ``argv`` from the repo root; its output goes to the log and is returned."""
        self.log.write(f"\n===== {name}: {' '.join(argv)}\n")
        self.log.flush()
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "PYTHONUNBUFFERED": "1"}
        # The output streams into the log, so a call cut off by the device's limit still brings back what a
        # command printed so far (on 2026-11-26 gpu_mfu's per-arm lines were lost that way).
        start = self.log.tell()
        try:
            code = subprocess.run(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = 124
            self.log.write(f"\ntimed out after {timeout_s:.0f} s\n")
        self.log.flush()
        with open(self.out / "runbook.log", encoding="utf-8", errors="replace") as log:
            log.seek(start)
            output = log.read()
        self.log.write(f"\n===== {name}: exit {code}\n")
        self.log.flush()
        return code, output

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runbook_out")),
                        help="where the block, the log and results.json go (default $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models: check the script, measure nothing")
    parser.add_argument("--append", type=Path, help="also append the block to this file (e.g. docs/verification.md)")
    parser.add_argument("--budget_s", type=float, default=500.0, help="start no section after this many seconds")
    parser.add_argument("--trl_size", default="0.5b", choices=["0.5b", "1.5b"])
    parser.add_argument("--mfu_sizes", nargs="+", default=["0.5b"], choices=["0.5b", "1.5b"],
                        help="gpu_mfu's model shapes (0.5b and 1.5b together outran a 540 s call on 2026-11-26)")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_runbook: no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    book = Runbook(args.out, args.dry_run, args.budget_s)
    book.section("GPU tests (packed == unpacked; CUDA syncs per step)", lambda: gpu_tests(book))
    book.section("check_packing in bf16", lambda: check_packing(book))
    book.section("Prefix sharing == two sequences", lambda: prefix_sharing(book))
    if args.dry_run:
        trl_settings = ("smoke", 2, 8, 16)
    else:
        trl_settings = (args.trl_size, 5, 32, 1)
    book.section("DPO tokens/s: openpack vs TRL", lambda: dpo_vs_trl(book, *trl_settings))
    book.section("MFU: packed vs padded DPO (benchmarks/gpu_mfu.py)", lambda: mfu(book, args.mfu_sizes))
    book.section("Fused LM head + loss vs chunked (benchmarks/fused_loss.py --head_only)", lambda: fused_loss(book))
    book.section("RL prefix sharing: one training-side pass (benchmarks/rl_prefix_sharing.py)",
                 lambda: rl_prefix_sharing(book))
    book.write()
    block = (args.out / "verification_block.md").read_text()
    print(block)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
