"""The full trainer on one GPU (issue 43): every openpack command through its CLI, exactly as a user runs it.

``examples/gpu_runbook.py`` runs this section first. Each command trains a Qwen2.5-0.5B-shaped model built from
a config (random init, saved once with a tokenizer, loaded by ``--pretrain`` like any HF folder) with
``--launcher local``, ``--bf16`` and the default ZeRO stage (2), on rows from the ANCHORS length mix (SFT, DPO,
RM) or two-digit additions (GRPO, PPO), and is checked four ways:

1. it exits 0, and its ``metrics.jsonl`` gives real tokens/s (the steps after the first) and, from the model's
   FLOPs per token, MFU against the matmul peak measured on the same GPU;
2. peak device memory in use while it runs (NVML, the whole GPU less what was in use before it started);
3. its step-1 loss against the same command's in fp32 on the CPU (``--bf16`` dropped, one step, no GPU), run in
   the background on the machine's other cores while the GPU runs go on;
4. its checkpoint: a second run with ``--load_checkpoint`` and one more step resumes at the saved step and
   continues.

The tokenizer is the demo's character tokenizer widened to Qwen2.5's 151,936 ids (the demo's 46 characters, then
one private-use or CJK character per id), so every id a random model samples decodes to text a reward can read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LN2 = 0.6931471805599453
# bf16 keeps 8 significant bits: each rounded value is off by up to 2^-9 (0.2%) of itself. A step-1 loss is a mean
# over thousands of tokens whose rounding errors partly cancel; 1% of the fp32 loss (0.01 at least, for losses
# near 0) is several times what check_packing measured for per-token log-probs in bf16 (docs/verification.md).
BF16_LOSS_RTOL, BF16_LOSS_ATOL = 0.01, 0.01

REWARD_FILE = '''"""The GPU runbook's RL reward: the share of a completion's characters with an even code point.

It has no task behind it: a random model cannot solve one, and GRPO's group-normalised advantages need rewards that
differ within a group. Every sampled id decodes to one character (the widened demo tokenizer), so this is about 0.5
with a spread of about 0.06 over 64 characters.
"""


def parity(prompts, completions, rows):
    return [sum(ord(c) % 2 == 0 for c in text) / max(1, len(text)) for text in completions]
'''


@dataclass
class Setup:
    """What every command of the section shares: model folders, data files and the FLOPs per token."""

    work: Path
    policy: Path
    reference: Path
    sft_data: Path
    pairs: Path
    prompts: Path
    reward_fn: str
    matmul_params: int
    attention_width: int
    layers: int
    sft_len: float  # token-weighted mean sequence length of an SFT row (attention FLOPs grow with it)
    pair_len: float  # the same for a prompt + response of a pair
    scale: int

    def flops_per_token(self, mean_len: float) -> float:
        """One pass: 2 FLOPs per matmul weight, plus causal attention (2 x L x width per layer at length L)."""
        return 2 * self.matmul_params + 2 * mean_len * self.attention_width * self.layers


@dataclass
class Command:
    """One command of the section; ``argv`` follows ``openpack`` and leaves out --save_path and --max_steps."""

    name: str
    argv: list[str]
    steps: int
    passes: int  # model passes per token counted as useful work (policy forward + backward = 3, a reference 1)
    mean_len: float
    reference: str | None  # the command whose fp32 CPU step-1 loss this one is held to; None: see ``why_not``
    why_not: str = ""
    needs: Path | None = None  # a file an earlier command makes (PPO: the reward model)
    checkpoint: str = "ZeRO-2"  # what its checkpoint holds; a dry run resumes one command of each kind only


@dataclass
class Result:
    name: str
    argv: list[str]
    exit: int | None = None
    resume_exit: int | None = None
    resumed: str = ""
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    loss1: float | None = None
    wall_s: float = 0.0
    resume_wall_s: float = 0.0
    checkpoint_gib: float | None = None
    metrics: list[dict] = field(default_factory=list)
    note: str = ""


def widened_tokenizer(vocab_size: int):
    """The demo tokenizer with one more character per id up to ``vocab_size`` (CJK, then private-use planes)."""
    from openpack.data.demo_tokenizer import CHARACTERS, SPECIAL_TOKENS, build_demo_tokenizer

    need = vocab_size - len(SPECIAL_TOKENS) - len(CHARACTERS)
    extra: list[str] = []
    for first, last in ((0x4E00, 0x9FFF), (0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD)):
        extra.extend(chr(c) for c in range(first, min(last + 1, first + need - len(extra))))
    tokenizer = build_demo_tokenizer("".join(extra[:max(0, need)]))
    tokenizer.model_max_length = 4096
    return tokenizer


def save_model(folder: Path, size: str, seed: int, tokenizer, gpu: bool) -> object:
    """A Qwen2.5-shaped model from a config (random init on the device it trains on), saved with ``tokenizer``."""
    import torch

    import gpu_mfu

    dtype = torch.bfloat16 if gpu else torch.float32
    model = gpu_mfu.build(size, dtype, "cuda" if gpu else "cpu", seed=seed)
    model.config._attn_implementation = "sdpa"  # a plain HF folder: openpack loads it with its own attention
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def token_weighted_len(lengths) -> float:
    lengths = [int(n) for n in lengths]
    return sum(n * n for n in lengths) / max(1, sum(lengths))


def prepare(work: Path, size: str, scale: int, gpu: bool) -> Setup:
    """Two model folders (policy seed 0, DPO reference seed 1) and the data files, in ``work``."""
    import harness
    from openpack.data.demo_task import demo_samples

    work.mkdir(parents=True, exist_ok=True)
    import gpu_mfu

    tokenizer = widened_tokenizer(gpu_mfu.SIZES[size]["vocab_size"])
    model = save_model(work / "policy", size, 0, tokenizer, gpu)
    params, config = gpu_mfu.matmul_params(model), model.config
    del model
    save_model(work / "reference", size, 1, tokenizer, gpu)
    lengths = harness.scaled_lengths(512, scale, seed=0)
    rows = harness.preference_rows(lengths, seed=0)
    harness.write_jsonl(work / "pairs.jsonl", rows)
    harness.write_jsonl(work / "sft.jsonl", [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows])
    harness.write_jsonl(work / "prompts.jsonl", [{"prompt": s["prompt"]} for s in demo_samples("train", 512)])
    (work / "reward.py").write_text(REWARD_FILE)
    if gpu:
        import torch

        torch.cuda.empty_cache()
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    return Setup(work, work / "policy", work / "reference", work / "sft.jsonl", work / "pairs.jsonl",
                 work / "prompts.jsonl", f"{work / 'reward.py'}:parity", params, width, config.num_hidden_layers,
                 token_weighted_len(lengths.prompt + lengths.chosen + 1),
                 token_weighted_len(list(lengths.prompt + lengths.chosen) + list(lengths.prompt + lengths.rejected)),
                 scale)


# The commands, in the order they run (the most valuable first: the budget may cut the tail); ``commands`` builds them.
COMMAND_NAMES = ("dpo", "sft", "dpo_prefix", "rm", "grpo", "ppo", "lora", "dpo_zero3", "sft_gc")


def dpo_pairs_per_step(scale: int) -> int:
    """Pairs per step of the DPO run compared with the harness and TRL: 64 (8 of TRL's micro-batches of 8);
    a dry run's tiny lengths take 8."""
    return 64 // scale


def commands(s: Setup) -> list[Command]:
    """The section's commands, in ``COMMAND_NAMES``'s order."""
    common = ["--launcher", "local", "--bf16", "--pretrain", str(s.policy), "--logging_steps", "1", "--seed", "0",
              "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--packing_samples", "--use_dynamic_batch",
              "--max_tokens_per_gpu", str(16384 // s.scale)]
    offline = [*common, "--max_len", str(2048 // s.scale)]
    sft = ["train_sft", *offline, "--dataset", str(s.sft_data), "--train_batch_size", "16",
           "--input_template", "None"]  # prompts bare, as the harness and TRL read them (the default is OpenRLHF's)
    pairs = [*offline, "--dataset", str(s.pairs), "--learning_rate", "1e-6"]
    # rewards unclipped, as measured before RL's default became OpenRLHF's -10 10 (issue 41)
    rl = [*common, "--rollout_backend", "hf", "--prompt_data", str(s.prompts), "--apply_chat_template",
          "--prompt_max_len", "32", "--generate_max_len", str(max(8, 64 // s.scale)), "--rollout_batch_size", "8",
          "--learning_rate", "1e-6", "--init_kl_coef", "0.01", "--reward_clip_range", "None"]
    sampled = "its completions are sampled, so an fp32 CPU run trains on others (rollout vs trainer log-probs below)"
    rm_model = s.work / "rm_model"
    every = [
        # policy == reference (no --ref_pretrain): step 1's loss is ln 2 in every precision; 64 pairs a step, rows
        # of <= 16384 tokens, as benchmarks/gpu_mfu.py's packed arm and the TRL arm run
        Command("dpo", ["train_dpo", *pairs, "--train_batch_size", str(dpo_pairs_per_step(s.scale))], 4, 4,
                s.pair_len, None,
                "policy == reference: the loss is ln 2 at step 1 in any precision"),
        Command("sft", [*sft, "--learning_rate", "1e-5"], 3, 3, s.sft_len, "sft"),
        Command("dpo_prefix", ["train_dpo", *pairs, "--train_batch_size", "8", "--prefix_sharing", "--ref_pretrain",
                               str(s.reference)], 3, 4, s.pair_len, "dpo_prefix"),
        Command("rm", ["train_rm", *pairs, "--train_batch_size", "8"], 3, 3, s.pair_len, "rm"),
        # GRPO: 8 prompts x 8 completions, one optimizer step each; KL to the reference (the initial policy) as a loss
        Command("grpo", ["train_grpo", *rl, "--train_batch_size", "64", "--reward_fn", s.reward_fn, "--use_kl_loss"],
                2, 3, 80.0, None, sampled, checkpoint="policy"),
        # PPO: 8 prompts x 4, GAE with a critic started from train_rm's reward model, which also scores them
        Command("ppo", ["train_ppo", *rl, "--train_batch_size", "32", "--n_samples_per_prompt", "4",
                        "--reward_pretrain", str(rm_model)], 2, 3, 80.0, None, sampled, needs=rm_model,
                checkpoint="policy and critic"),
        Command("lora", [*sft, "--lora_rank", "16", "--lora_alpha", "32", "--learning_rate", "1e-4"], 3, 2,
                s.sft_len, "lora", checkpoint="LoRA adapters"),
        Command("dpo_zero3", ["train_dpo", *pairs, "--train_batch_size", "8", "--prefix_sharing", "--ref_pretrain",
                              str(s.reference), "--zero_stage", "3"], 3, 4, s.pair_len, "dpo_prefix",
                checkpoint="ZeRO-3"),
        Command("sft_gc", [*sft, "--learning_rate", "1e-5", "--gradient_checkpointing"], 3, 3, s.sft_len, "sft"),
    ]
    assert tuple(c.name for c in every) == COMMAND_NAMES
    return every


def selected(every: list[Command], only: list[str] | None) -> list[Command]:
    """``only``'s commands in its order (all of ``every`` without it); PPO, which needs train_rm's model, gets
    ``rm`` run just before it when ``only`` leaves ``rm`` out."""
    if not only:
        return every
    by_name = {c.name: c for c in every}
    picked: list[str] = []
    for name in only:
        if by_name[name].needs is not None and "rm" not in only and "rm" not in picked:
            picked.append("rm")
        if name not in picked:
            picked.append(name)
    return [by_name[n] for n in picked]


def cpu_reference_argv(command: Command) -> list[str]:
    """The same command in fp32 for one step (step 1 is the same whatever --max_steps says)."""
    return [a for a in command.argv if a != "--bf16"] + ["--max_steps", "1"]


def read_metrics(save_path: Path) -> list[dict]:
    path = save_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def folder_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


class DeviceMemory:
    """The GPU's memory in use (NVML), sampled every 0.1 s on a thread; ``peak_gib`` is above the baseline."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle, self.nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # no NVML (CPU dry run): nothing to sample
            self.handle = None
        self.peak = self.base = 0

    def used(self) -> int:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used

    def __enter__(self):
        if self.handle is not None:
            self.base = self.peak = self.used()
            self.done = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.1):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc):
        if self.handle is not None:
            self.done.set()
            self.thread.join()

    @property
    def peak_gib(self) -> float | None:
        return (self.peak - self.base) / 2**30 if self.handle is not None else None


class CpuReferences:
    """fp32 step-1 losses on the CPU, one command after another on a background thread (no GPU visible)."""

    def __init__(self, setup: Setup, threads: int):
        self.setup, self.threads = setup, threads
        self.losses: dict[str, float | str] = {}
        self.step1: dict[str, dict] = {}  # every metric of the fp32 step 1 (rewards, margins, log-probs)
        self.log: list[str] = []
        self.queue: list[Command] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self, every: list[Command], selected: list[Command]) -> None:
        """Run the fp32 step 1 of every command whose loss one of ``selected`` is held to."""
        wanted = {c.reference for c in selected}
        self.queue = [c for c in every if c.name in wanted]
        self.thread.start()

    def _run(self) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(self.threads),
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
        for command in self.queue:
            save = self.setup.work / f"cpu_{command.name}"
            argv = [sys.executable, "-m", "openpack.cli.main", *cpu_reference_argv(command), "--save_path", str(save)]
            began = time.monotonic()
            run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, errors="replace")
            metrics = read_metrics(save)
            self.log.append(f"\n===== fp32 CPU reference {command.name}: {' '.join(argv)}\n{run.stdout}{run.stderr}"
                            f"\n===== exit {run.returncode} in {time.monotonic() - began:.0f} s\n")
            self.losses[command.name] = metrics[0]["loss"] if run.returncode == 0 and metrics else (
                f"exit {run.returncode}")
            self.step1[command.name] = metrics[0] if metrics else {}
            shutil.rmtree(save, ignore_errors=True)

    def wait(self, seconds: float) -> bool:
        self.thread.join(max(0.0, seconds))
        return not self.thread.is_alive()


def steady_tokens_per_s(metrics: list[dict], key: str = "tokens") -> float | None:
    """Tokens over time summed over the steps after the first (its time holds the warm-up)."""
    rest = metrics[1:] or metrics
    time_s = sum(m["step_time_s"] for m in rest)
    return sum(m[key] for m in rest) / time_s if rest and time_s else None


def rl_training_tokens_per_s(metrics: list[dict]) -> float | None:
    rest = metrics[1:] or metrics
    time_s = sum(m["time/training"] for m in rest)
    return sum(m["training_tokens_per_s"] * m["time/training"] for m in rest) / time_s if rest and time_s else None


def run_command(book, setup: Setup, command: Command, peak_tflops: float, resume: bool = True) -> Result:
    """Run ``command`` for its steps, then (``resume``) resume it for one more; the run folder is removed after
    (a 0.5B checkpoint in bf16 with its AdamW state is 7.4 GB)."""
    save = setup.work / "runs" / command.name
    argv = [sys.executable, "-m", "openpack.cli.main", *command.argv, "--save_path", str(save)]
    result = Result(command.name, ["openpack", *command.argv, "--save_path", str(save)])
    if command.needs is not None and not command.needs.exists():
        result.note = f"not run: {command.needs.name} was not made (an earlier command failed)"
        return result
    began = time.monotonic()
    with DeviceMemory() as memory:
        result.exit, _ = book.command(f"full trainer: {command.name}", [*argv, "--max_steps", str(command.steps)],
                                      600)
    result.wall_s, result.peak_gib = time.monotonic() - began, memory.peak_gib
    result.metrics = read_metrics(save)
    if result.metrics:
        result.loss1 = result.metrics[0].get("loss")
        rl = "time/training" in result.metrics[0]
        result.tokens_per_s = rl_training_tokens_per_s(result.metrics) if rl else steady_tokens_per_s(result.metrics)
        passes = 3 if rl else command.passes  # RL: the training phase's policy forward + backward
        if result.tokens_per_s and peak_tflops:
            result.mfu = passes * setup.flops_per_token(command.mean_len) * result.tokens_per_s / (peak_tflops * 1e12)
    checkpoints = sorted((save / "checkpoints").glob("global_step*"))
    result.checkpoint_gib = folder_gib(checkpoints[-1]) if checkpoints else None
    if result.exit == 0 and not resume:
        result.resumed = (f"not run (dry run: one {command.checkpoint} resume only)" if book.dry_run else
                          "not run (--no_resume)")
    elif result.exit == 0:
        began = time.monotonic()
        more = [*argv, "--max_steps", str(command.steps + 1), "--load_checkpoint"]
        result.resume_exit, output = book.command(f"full trainer: {command.name} resumed", more, 600)
        result.resume_wall_s = time.monotonic() - began
        steps = [m["step"] for m in read_metrics(save)]
        at = f"at step {command.steps} "
        resumed = any(line.startswith("resumed from") and at in line for line in output.splitlines())
        if result.resume_exit == 124:
            result.resumed = "stopped by the budget before it finished"
        elif result.resume_exit != 0:
            result.resumed = f"failed: exit {result.resume_exit} (runbook.log)"
        else:
            result.resumed = ("yes" if resumed and steps == list(range(1, command.steps + 2)) else
                              f"no (logged steps {steps}; 'resumed from ... {at.strip()}' "
                              f"{'found' if resumed else 'missing'})")
    if command.name == "rm" and (save / "model").is_dir():
        shutil.move(str(save / "model"), setup.work / "rm_model")  # PPO's reward model
    shutil.rmtree(save, ignore_errors=True)
    return result


def loss_check(result: Result, command: Command, references: CpuReferences) -> str:
    if result.loss1 is None:
        return "no step 1"
    if command.reference is None:
        if command.name == "dpo":
            ok = abs(result.loss1 - LN2) <= BF16_LOSS_ATOL
            return f"{result.loss1:.4f} vs ln 2 = {LN2:.4f}: {'within' if ok else 'OUTSIDE'} tolerance"
        return f"{result.loss1:.4g}; not compared: {command.why_not}"
    ref = references.losses.get(command.reference)
    if ref is None:
        return f"{result.loss1:.5g} vs fp32 CPU: not finished within the budget"
    if isinstance(ref, str):
        return f"{result.loss1:.5g} vs fp32 CPU: the CPU run failed ({ref}; runbook.log)"
    tolerance = max(BF16_LOSS_RTOL * abs(ref), BF16_LOSS_ATOL)
    same = "" if command.reference == command.name else f" (`{command.reference}`'s: the same loss)"
    verdict = "within" if abs(result.loss1 - ref) <= tolerance else "OUTSIDE"
    return f"{result.loss1:.5g} vs {ref:.5g}{same}: diff {result.loss1 - ref:+.2e}, {verdict} tolerance"


def table(results: list[Result], cmds: list[Command], references: CpuReferences) -> list[str]:
    by_name = {c.name: c for c in cmds}
    lines = ["| command | exit | tokens/s | MFU | peak memory (GiB) | step-1 loss (bf16 GPU vs fp32 CPU) | "
             "checkpoint (GiB) | resume | wall s (run, resume) |", "|---|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in results:
        if r.exit is None:
            lines.append(f"| `{r.name}` | | | | | {r.note} | | | |")
            continue
        lines.append(f"| `{r.name}` | {r.exit} | {_fmt(r.tokens_per_s, '.0f')} | {_fmt(r.mfu, '.1%')} | "
                     f"{_fmt(r.peak_gib, '.1f')} | {loss_check(r, by_name[r.name], references)} | "
                     f"{_fmt(r.checkpoint_gib, '.1f')} | {r.resumed or 'not run: the run failed'} | "
                     f"{r.wall_s:.0f}, {r.resume_wall_s:.0f} |")
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def rl_lines(results: list[Result]) -> list[str]:
    """Where an RL step's time goes, and the rollout vs trainer log-prob gap on the same tokens (step 1)."""
    lines = []
    for r in results:
        if not r.metrics or "time/generation" not in r.metrics[0]:
            continue
        m = r.metrics[-1]
        split = ", ".join(f"{k[5:]} {m[k]:.2f} s" for k in m if k.startswith("time/"))
        lines.append(f"- `{r.name}` step {m['step']}: {m['step_time_s']:.2f} s ({split}); generation "
                     f"{m.get('generation_tokens_per_s', 0):.0f} tokens/s; rollout vs trainer log-prob gap at step 1 "
                     f"(`vllm_logp_diff`, HF bf16 generate vs the bf16 trainer): "
                     f"{r.metrics[0].get('vllm_logp_diff', float('nan')):.3g}; "
                     f"reward {r.metrics[0].get('reward', 0):.3f}")
    return lines


def describe_commands(results: list[Result], work: Path) -> list[str]:
    return [f"- `{r.name}`: `{' '.join(r.argv).replace(str(work), '$WORK')} --max_steps N`" for r in results]
