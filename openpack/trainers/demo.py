"""The built-in demo that every command falls back to without --pretrain/--dataset.

A 3-layer, width-128 Llama over the 46-token demo tokenizer (about 0.4M
parameters), trained from random initialisation on 2-digit addition
(``openpack.data.demo_task``), judged by greedy decoding of every held-out
problem: the share of right answers (either answer form) and the share in
the bare form the preference pairs prefer. Runs offline on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
from pathlib import Path

import torch

import openpack

from openpack.data.demo_task import WORDY_SHARE, answer_rates, demo_preference_pairs, demo_samples, write_jsonl
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.prepared import cache_root  # noqa: F401  (demo models are cached there too)
from openpack.models.loading import load_causal_lm, load_tokenizer, prepare_for_training
from openpack.models.tiny import tiny_causal_lm

DEMO_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
TRAIN_SAMPLES = 8960  # 140 steps of 64 per epoch
PREFERENCE_SAMPLES = 4096
REWARD_SAMPLES = 8960  # two passes over the ~9,000 training problems: judging a sum right needs more than DPO
PROMPT_SAMPLES = 4096  # RL prompts: more than a demo run samples, so no prompt repeats
EVAL_SAMPLES = 1022  # every held-out problem


@contextlib.contextmanager
def building(cache: Path):
    """Held while this process checks for a cached demo folder and builds it if missing. Another process that asks
    for the same folder meanwhile (two runs started at once, the test suite's workers) waits here for the first,
    then finds the folder built, instead of failing on the save path's lock (``distributed/save_path.py``)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"openpack: waiting for another process that is building {cache}", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def code_key(*recipe_files: Path) -> str:
    """A digest of everything that changes a model the demo trains, to name its cache folder.

    That is the recipe files, every source file of the package (the training path runs through most of
    them, and a missed one is how a stale demo model once passed CI on one machine and failed on fresh
    ones), openpack's version and the versions of the libraries that do the numerics. Any change trains
    the demo model anew (about a minute on 2 CPU cores) rather than reuse one trained by other code.
    """
    digest = hashlib.sha256()
    root = Path(openpack.__file__).resolve().parent
    for path in [*map(Path, recipe_files), *sorted(root.rglob("*.py"))]:
        digest.update(str(path.relative_to(root) if path.is_relative_to(root) else path.name).encode())
        digest.update(path.read_bytes())
    for library in ("torch", "transformers", "deepspeed"):
        digest.update(f"{library}=={importlib.metadata.version(library)}".encode())
    digest.update(f"openpack=={openpack.__version__}".encode())
    return digest.hexdigest()[:12]


def tokenizer_and_model(model_cfg, seed: int):
    """The user's --pretrain, or the demo's tokenizer and a random-init tiny model."""
    if model_cfg.pretrain is not None:
        tokenizer = load_tokenizer(model_cfg.pretrain)
        return tokenizer, load_causal_lm(model_cfg.pretrain, model_cfg.bf16, model_cfg.gradient_checkpointing,
                                         load_in_4bit=model_cfg.load_in_4bit,
                                         aux_loss_coef=model_cfg.aux_loss_coef)
    tokenizer = build_demo_tokenizer()
    dtype = torch.bfloat16 if model_cfg.bf16 else torch.float32
    model = tiny_causal_lm("llama", seed=seed, dtype=dtype, vocab_size=len(tokenizer), **DEMO_MODEL).train()
    return tokenizer, prepare_for_training(model, model_cfg.gradient_checkpointing)


def write_sft_data(save_path: Path, is_main: bool) -> list[str]:
    """The demo's training split as JSONL (so it goes through the normal loader); returns [path]."""
    rows = demo_samples("train", TRAIN_SAMPLES, wordy_share=WORDY_SHARE)
    return _write_demo_rows(Path(save_path) / "demo_data" / "sft_train.jsonl", rows, is_main)


def _write_demo_rows(path: Path, rows: list[dict], is_main: bool) -> list[str]:
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(rows, path)
    return [str(path)]


def accuracy(model, tokenizer, n: int = EVAL_SAMPLES) -> dict[str, float]:
    """Greedy decoding of ``n`` held-out problems: ``eval_exact_match`` (the right sum, in either answer
    form) and ``eval_bare_answer`` (the right sum in the bare form, as the preference pairs prefer)."""
    from openpack.models.generation import greedy_completions

    held_out = demo_samples("test", n)
    predictions = greedy_completions(model, tokenizer, [s["prompt"] for s in held_out], max_new_tokens=10)
    right, bare = answer_rates(predictions, [s["response"] for s in held_out])
    return {"eval_exact_match": right, "eval_bare_answer": bare}


def describe(rates: dict[str, float]) -> str:
    """``right answers 97.3% (0.6% in the bare form)``."""
    return f"right answers {rates['eval_exact_match']:.1%} ({rates['eval_bare_answer']:.1%} in the bare form)"


def write_preference_data(save_path: Path, is_main: bool, n: int = PREFERENCE_SAMPLES,
                          name: str = "dpo_train.jsonl") -> list[str]:
    """The demo's training preference pairs as JSONL: chosen the bare right answer, rejected its wordy form or a
    plausible wrong one."""
    return _write_demo_rows(Path(save_path) / "demo_data" / name, demo_preference_pairs("train", n), is_main)


def write_prompt_data(save_path: Path, is_main: bool, n: int = PROMPT_SAMPLES) -> list[str]:
    """The demo's RL prompts as JSONL: training problems with their bare answer under ``response``."""
    return _write_demo_rows(Path(save_path) / "demo_data" / "rl_prompts.jsonl", demo_samples("train", n), is_main)


def preference_eval_pairs(tokenizer, n: int = EVAL_SAMPLES):
    """Held-out preference pairs, tokenized like the training pairs."""
    from openpack.data.loading import Rows
    from openpack.data.preference import tokenize_pairs

    rows = demo_preference_pairs("test", n)
    pairs, _ = tokenize_pairs(Rows(rows, [f"demo test pair {i}" for i in range(n)]), tokenizer)
    return pairs


def preference_accuracy(policy: tuple, ref: tuple | None, beta: float) -> float:
    """Share of pairs whose implicit reward beta * (policy - reference) prefers chosen; a tie counts half.

    ``policy`` and ``ref`` are (chosen, rejected) log-prob sums [P]. Before
    training policy == reference, every reward is 0 and the accuracy is 50%.
    """
    chosen, rejected = policy
    if ref is not None:
        chosen, rejected = chosen - ref[0], rejected - ref[1]
    margin = beta * (chosen - rejected)
    return ((margin > 0).float() + 0.5 * (margin == 0).float()).mean().item()
