"""Peak memory of ``openpack train_sft / train_dpo / train_rm`` on a real model vs TRL 1.16, with a profile by phase.

    python examples/real_model_check.py --convert_only /work/smollm2      # SmolLM2-135M-Instruct, fp32 HF folder
    python benchmarks/memory_real_model.py --model /work/smollm2 [--commands sft dpo rm] [--steps 2]
    python benchmarks/memory_real_model.py --smoke --out /tmp/x          # a tiny random model: checks the harness

Issue 23: on SmolLM2-135M in fp32 (weights, gradients and AdamW states
about 2.2 GB) openpack's largest process peaked at 6.0-7.7 GB. Each command
runs twice, one after the other, on the same model and rows: openpack as a
user runs it (the Ray launcher, the default ZeRO stage) and TRL's trainer
(``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``; the workers of
``sft_vs_trl.py``, ``dpo_vs_trl.py`` and ``rm_vs_trl.py``) in one process.

* Micro-batches of the same tokens: every row is ``--prompt_tokens`` +
  ``--response_tokens`` + eos (<= ``--max_len``), so openpack's 2048-token
  packs and TRL's micro-batches of ``2048 // max_len`` rows (SFT) or
  ``2048 // (2 max_len)`` pairs (DPO, RM) hold the same tokens, unpadded.
* Memory: a sampler reads ``VmHWM`` and ``VmRSS`` of every process of the
  run's tree every 0.1 s; each process also records its own ``VmHWM`` as it
  exits (``harness.run_measured``'s wrapper, for the top process). Reported:
  the largest process's peak, and the peak of the sum of all the run's
  processes' resident memory (Ray's driver, raylet, GCS and actors).
* Phases: openpack's ranks run with ``$OPENPACK_MEMORY_TRACE`` set
  (``openpack.models.memory.mark_memory``): resident memory at the end of
  model load, engine init, each forward, backward and optimizer step of the
  first two steps, the checkpoint and the final model save, with each
  phase's own peak.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpo_vs_trl
import harness
import numpy as np
import rm_vs_trl
import sft_vs_trl
from packing import PairLengths

from openpack.models.memory import MEMORY_TRACE

COMMANDS = ("sft", "dpo", "rm")
SECTION = "memory_real_model"
COMPILERS = ("cc1plus", "c++", "g++", "gcc", "ninja", "ld", "as ")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("/work/smollm2"), help="an HF causal LM folder (fp32)")
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS), help="what to run")
    parser.add_argument("--rows", type=int, default=64, help="rows in the dataset")
    parser.add_argument("--prompt_tokens", type=int, default=128, help="tokens of every prompt")
    parser.add_argument("--response_tokens", type=int, default=382, help="tokens of every response")
    parser.add_argument("--max_len", type=int, default=512, help="--max_len (TRL: max_length)")
    parser.add_argument("--max_tokens_per_gpu", type=int, default=2048, help="openpack's token cap (the issue's)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of each run")
    parser.add_argument("--micro_batches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="results.json of an earlier run, shown as the 'before' columns of the docs section")
    harness.add_output_args(parser, SECTION, chart=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and rows, 1 step; no docs")
    args = parser.parse_args(argv)
    args.flags = harness.given_flags(argv)
    if args.smoke:
        args.rows, args.prompt_tokens, args.response_tokens, args.max_len, args.max_tokens_per_gpu = 16, 8, 20, 32, 64
        args.steps = 1
    args.markdown, _ = harness.docs_outputs(args.markdown, None, SECTION, args.smoke)
    args.rows_per_micro_batch = args.max_tokens_per_gpu // args.max_len
    if args.prompt_tokens + args.response_tokens + 1 > args.max_len or args.rows_per_micro_batch < 2:
        parser.error("every row (prompt + response + eos) must fit --max_len, and a pair --max_tokens_per_gpu")
    return args


# ---------------------------------------------------------------- data


def word_tokens(tokenizer) -> list[int]:
    """Ids of single-token lowercase words with a leading space: any sequence of them re-tokenizes to itself."""
    return sorted(i for token, i in tokenizer.get_vocab().items() if re.fullmatch(r"Ġ[a-z]{3,8}", token))


def token_rows(tokenizer, args) -> list[dict]:
    """{prompt, chosen, rejected} rows of exactly --prompt_tokens and --response_tokens tokens (seed 0)."""
    words, rng = word_tokens(tokenizer), random.Random(0)

    def text(length: int) -> str:
        ids = [rng.choice(words) for _ in range(length)]
        decoded = tokenizer.decode(ids)
        assert tokenizer(decoded, add_special_tokens=False).input_ids == ids, "a word row did not round-trip"
        return decoded

    return [{"prompt": text(args.prompt_tokens), "chosen": text(args.response_tokens),
             "rejected": text(args.response_tokens)} for _ in range(args.rows)]


def prepare(args, work: Path) -> dict:
    from transformers import AutoTokenizer

    model = args.model
    if args.smoke:  # the sft_vs_trl smoke model (demo tokenizer: one character a token, so no word tokens)
        spec = harness.ModelSpec(512, 32, 64, 2, max_position_embeddings=256)
        (model,) = harness.save_models(work, spec, seeds=[0])
        lengths = [np.full(args.rows, n) for n in (args.prompt_tokens, args.response_tokens, args.response_tokens)]
        rows = harness.preference_rows(PairLengths(*lengths))
    else:
        rows = token_rows(AutoTokenizer.from_pretrained(model), args)
    setup = {"work": work, "model": model, "reward_model": work / "reward_model",
             "pairs": harness.write_jsonl(work / "pairs.jsonl", rows),
             "sft": harness.write_jsonl(work / "sft.jsonl",
                                        [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])}
    if "rm" in args.commands:
        rm_vs_trl.save_reward_model(model, setup["reward_model"], seed=0)
    return setup


# ---------------------------------------------------------------- runs


def samples_per_step(command: str, args) -> int:
    """SFT rows or DPO/RM pairs per optimizer step: --micro_batches full micro-batches."""
    per_micro = args.rows_per_micro_batch if command == "sft" else args.rows_per_micro_batch // 2
    return per_micro * args.micro_batches


def openpack_command(command: str, args, setup: dict, save_path: Path) -> list[str]:
    # SFT rows read by OpenRLHF's keys, prompts bare as TRL reads them (train_sft's default template is OpenRLHF's)
    sft_keys = ["--input_key", "prompt", "--output_key", "completion", "--input_template", "None"]
    keys = sft_keys if command == "sft" else []
    return [
        "-m", "openpack.cli.main", f"train_{command}",
        "--pretrain", str(setup["reward_model"] if command == "rm" else setup["model"]),
        "--dataset", str(setup["sft" if command == "sft" else "pairs"]), *keys,
        "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", str(args.max_tokens_per_gpu),
        "--max_len", str(args.max_len), "--train_batch_size", str(samples_per_step(command, args)),
        "--max_steps", str(args.steps), "--learning_rate", "1e-5", "--lr_scheduler", "constant",
        "--lr_warmup_ratio", "0", "--save_path", str(save_path),
    ]


def trl_spec(command: str, args, setup: dict, run_dir: Path) -> tuple[Path, dict]:
    """The script whose ``--trl_worker`` runs TRL's trainer, and its spec (``micro_batch``: rows or pairs)."""
    common = {"out": str(run_dir), "steps": args.steps, "max_length": args.max_len, "learning_rate": 1e-5,
              "seed": 0, "micro_batch": samples_per_step(command, args) // args.micro_batches}
    if command == "sft":
        return Path(sft_vs_trl.__file__), {**common, "model": str(setup["model"]), "dataset": str(setup["sft"]),
                                           "packing": False, "accumulation": args.micro_batches}
    pairs = {**common, "dataset": str(setup["pairs"]), "pairs_per_step": samples_per_step(command, args)}
    if command == "dpo":
        return Path(dpo_vs_trl.__file__), {**pairs, "policy": str(setup["model"]), "reference": str(setup["model"]),
                                           "beta": 0.1}
    return Path(rm_vs_trl.__file__), {**pairs, "model": str(setup["reward_model"])}


def run_tree(argv: list[str], run_dir: Path, env: dict) -> dict:
    """``python argv`` (through harness's peak-recording wrapper), sampled; the largest process, the sum, phases."""
    run_dir.mkdir(parents=True, exist_ok=True)
    report, trace = run_dir / "top_process.json", run_dir / "memory_trace.jsonl"
    cmd = [sys.executable, harness.__file__, "--peak_rss_to", str(report), *argv]
    start = time.perf_counter()
    with open(run_dir / "run.log", "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, MEMORY_TRACE: str(trace)},
                                   cwd=harness.REPO)
        sampler = harness.TreeSampler(process.pid)
        returncode = process.wait()
        sampler.stop()
    if returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} exited with {returncode}; log {run_dir / 'run.log'}:\n"
                           + (run_dir / "run.log").read_text()[-3000:])
    processes = sampler.processes
    processes.setdefault(process.pid, {"name": "top", "peak_mb": 0.0})
    processes[process.pid]["peak_mb"] = max(processes[process.pid]["peak_mb"],
                                            json.loads(report.read_text())["peak_rss_mb"])
    phases = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    for phase in phases:  # each mark resets VmHWM: a phase's peak can fall between two samples
        entry = processes.setdefault(phase["pid"], {"name": "rank", "peak_mb": 0.0})
        entry["peak_mb"] = max(entry["peak_mb"], phase["peak_mb"])
    # DeepSpeed compiles its comm op on a fresh machine (cc1plus children of the rank, ~1.5 GiB each, once): in the
    # sum, not the largest process
    largest = max((pid for pid in processes if not processes[pid]["name"].startswith(COMPILERS)),
                  key=lambda pid: processes[pid]["peak_mb"])
    return {"largest_mb": processes[largest]["peak_mb"], "largest_name": processes[largest]["name"],
            "sum_mb": sampler.peak_sum_mb, "processes": len(processes), "wall_s": time.perf_counter() - start,
            "phases": [p for p in phases if p["pid"] == largest],
            "top": sorted(processes.values(), key=lambda p: -p["peak_mb"])[:5]}


def run_command(command: str, args, setup: dict, env: dict) -> dict:
    work = setup["work"]
    ours = run_tree(openpack_command(command, args, setup, work / f"openpack_{command}"),
                    work / f"openpack_{command}_run", env)
    script, spec = trl_spec(command, args, setup, work / f"trl_{command}")
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    spec_path = Path(spec["out"]) / "spec.json"
    spec_path.write_text(json.dumps(spec))
    theirs = run_tree([str(script), "--trl_worker", str(spec_path)], work / f"trl_{command}_run", env)
    trl_steps = json.loads((Path(spec["out"]) / "steps.json").read_text())["steps"]
    metrics = [m for m in harness.read_jsonl(work / f"openpack_{command}" / "metrics.jsonl") if "loss" in m]
    result = {"command": command, "openpack": ours, "TRL": theirs, "ratio": ours["largest_mb"] / theirs["largest_mb"],
              "openpack_tokens_per_micro_batch": metrics[0]["tokens"] / metrics[0]["micro_batches"],
              "trl_tokens_per_micro_batch": trl_steps[0]["tokens"] / trl_steps[0]["micro_batches"],
              "openpack_loss": metrics[0]["loss"], "trl_loss": trl_steps[0]["loss"]}
    print(f"  {command}: openpack largest {ours['largest_mb']:.0f} MiB ({ours['largest_name']}), sum "
          f"{ours['sum_mb']:.0f} MiB; TRL {theirs['largest_mb']:.0f} MiB; ratio {result['ratio']:.2f}", flush=True)
    return result


# ---------------------------------------------------------------- docs


def phase_table(results: list[dict], baseline: list[dict] | None) -> str:
    """One row per phase of the largest openpack process: resident memory at its end and its own peak (MiB)."""
    lines = []
    for result in results:
        before = next((b for b in baseline or [] if b["command"] == result["command"]), None)
        lines += [f"`train_{result['command']}`, {result['openpack']['largest_name']}:", ""]
        if before:
            lines += ["| phase | before: RSS at end | before: peak in phase | after: RSS at end "
                      "| after: peak in phase |", "|---|---:|---:|---:|---:|"]
        else:
            lines += ["| phase | RSS at end | peak in phase |", "|---|---:|---:|"]
        old = _phases_once(before["openpack"]["phases"]) if before else []
        for index, phase in enumerate(_phases_once(result["openpack"]["phases"])):
            cells = [f"{phase['rss_mb']:.0f}", f"{phase['peak_mb']:.0f}"]
            if before:
                was = old[index] if index < len(old) and old[index]["phase"] == phase["phase"] else None
                cells = [f"{was['rss_mb']:.0f}" if was else "", f"{was['peak_mb']:.0f}" if was else ""] + cells
            lines.append(f"| {phase['phase']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _phases_once(phases: list[dict]) -> list[dict]:
    """Micro-batches of a step merged: one forward and one backward row per step (the largest of each); other
    phases in order, a repeated one (DPO loads its reference model with the same flag) as a row of its own."""
    merged: list[dict] = []
    for phase in phases:
        name = phase["phase"]
        same = next((m for m in merged if m["phase"] == name), None) if re.fullmatch(r"step \d+ \w+", name) else None
        if same is None:
            merged.append(dict(phase))
        else:
            for key in ("rss_mb", "peak_mb"):
                same[key] = max(same[key], phase[key])
    return merged


def peak_table(results: list[dict], baseline: list[dict] | None) -> str:
    lines = ["| command | tokens / micro-batch (openpack, TRL) | openpack largest process | openpack all processes "
             "| TRL (one process) | openpack / TRL (largest) |" + (" before: largest, / TRL |" if baseline else ""),
             "|---|---|---:|---:|---:|---:|" + ("---:|" if baseline else "")]
    for r in results:
        before = next((b for b in baseline or [] if b["command"] == r["command"]), None)
        extra = f" {before['openpack']['largest_mb']:.0f} MiB, {before['ratio']:.2f}x |" if before else \
            (" |" if baseline else "")
        lines.append(f"| `train_{r['command']}` | {r['openpack_tokens_per_micro_batch']:.0f}, "
                     f"{r['trl_tokens_per_micro_batch']:.0f} | {r['openpack']['largest_mb']:.0f} MiB "
                     f"| {r['openpack']['sum_mb']:.0f} MiB ({r['openpack']['processes']} processes) "
                     f"| {r['TRL']['largest_mb']:.0f} MiB | **{r['ratio']:.2f}x** |{extra}")
    return "\n".join(lines)


def markdown_section(args, results: list[dict], baseline: list[dict] | None, wall_s: float) -> str:
    commands = " ".join(args.commands)
    return f"""## Memory on a real model: SmolLM2-135M, openpack vs TRL (`benchmarks/memory_real_model.py`)

```
python benchmarks/memory_real_model.py {args.flags}
```

Machine: {harness.machine_description()}; {harness.code_description()}. The script took {wall_s:.0f} s
({commands}: one openpack run and one TRL run each, one after the other; the machine was shared with other work).

Model: `{args.model.name}` (SmolLM2-135M-Instruct as an fp32 HF folder, 134.5M parameters, tied embeddings, vocab
49152); weights, gradients and AdamW moments are 4 + 4 + 8 bytes a parameter, 2.0 GiB. Rows: {args.rows} rows of
{args.prompt_tokens} prompt + {args.response_tokens} response tokens (random single-token words), so every
sequence is {args.prompt_tokens + args.response_tokens + 1} tokens with the eos and nothing is padded or truncated.
openpack: `--launcher ray` and `--zero_stage 2` (the defaults; one CPU rank runs it as stage 0),
`--packing_samples --use_dynamic_batch
--max_tokens_per_gpu {args.max_tokens_per_gpu} --max_len {args.max_len}`, {args.micro_batches} micro-batches a
step, {args.steps} steps, then its checkpoint and final model save. TRL 1.16: the same rows,
`max_length={args.max_len}`, {args.rows_per_micro_batch} rows (SFT) or {args.rows_per_micro_batch // 2} pairs
(DPO, RM: twice the rows) per micro-batch, the same micro-batches a step, no gradient checkpointing, fp32,
AdamW, no save. "All processes" is the peak of the summed resident memory of the run's process tree (Ray's
driver, GCS, raylet, agents and the rank actor), sampled every 0.1 s; a process's own peak is its `VmHWM`.

{peak_table(results, baseline)}

The largest process's resident memory by phase (MiB; `OPENPACK_MEMORY_TRACE`, see
`openpack/models/memory.py`); "peak in phase" is the high-water mark since the previous row, each row resetting
it. A step's micro-batches share one forward and one backward row (the largest of them).

{phase_table(results, baseline)}"""


# ---------------------------------------------------------------- entry


def benchmark(args, work: Path) -> int:
    started = time.perf_counter()
    setup = prepare(args, work)
    env = harness.subprocess_env(args.threads)
    results = [run_command(command, args, setup, env) for command in args.commands]
    wall_s = time.perf_counter() - started
    baseline = json.loads(args.baseline.read_text())["results"] if args.baseline else None
    (work / "results.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                   "results": results, "wall_s": wall_s}, indent=1))
    print(peak_table(results, baseline))
    print(phase_table(results, baseline))
    if args.markdown is not None:
        harness.write_section(args.markdown, SECTION, markdown_section(args, results, baseline, wall_s))
    return 0


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, None, "memory_real_model_")


if __name__ == "__main__":
    sys.exit(main())
