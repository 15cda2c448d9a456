"""The built-in multi-turn demo (``openpack train_grpo --demo agent``): three-digit multiplication with a calculator.

The demo model (the 3-layer, width-128 Llama of ``trainers/demo.py``) over a character tokenizer that also knows
JSON's characters and the Hermes markers ``<tool_call>``/``</tool_call>`` (one token each) cannot multiply two
three-digit numbers itself, but it can call ``multiply`` and copy the result::

    <bos>system: tools multiply
    user: 417*385=
    assistant: <tool_call>{"name":"multiply","arguments":{"a":417,"b":385}}</tool_call><eos>tool: 160545
    assistant: 160545<eos>

The chat template shows the tools (``tools=``) as that system line and tool results as ``tool:`` turns. An SFT stage
(``openpack train_sft`` on conversations where the assistant calls the tool in ``TOOL_SHARE`` of them and answers
directly otherwise) gives a model that sometimes calls it; GRPO with the built-in tool loop (``--tools``, exact
match with the label) then teaches it to call it every time. Held-out success: the share of greedy episodes on
``EVAL_PROBLEMS`` unseen problems whose final answer is right (``eval_tool_success``).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from openpack.data.demo_tokenizer import CHAT_TEMPLATE as DEMO_CHAT_TEMPLATE, build_demo_tokenizer
from openpack.trainers.demo import DEMO_MODEL, cache_root, code_key

TOOL_SHARE = 0.35  # SFT conversations that call the tool; the others answer (mostly wrongly) at once
SFT_SAMPLES = 8000
PROMPTS = 4096
EVAL_PROBLEMS = 256
TOOL_CALL, TOOL_END = "<tool_call>", "</tool_call>"
EXTRA_CHARACTERS = '{}",_*'
MAX_POSITIONS = 160

# the demo tokenizer's template with the tools shown as a system line after <bos>
CHAT_TEMPLATE = DEMO_CHAT_TEMPLATE.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{%- if tools -%}{{ 'system: tools' }}{%- for tool in tools -%}{{ ' ' + tool['function']['name'] }}"
    "{%- endfor -%}{{ '\n' }}{%- endif -%}", 1)

TOOLS_FILE = '''"""The agent demo's calculator (``openpack train_grpo --demo agent``)."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
'''


def build_agent_tokenizer():
    """The demo tokenizer with JSON's characters and the two tool-call markers (added, not special: decoding an
    action with ``skip_special_tokens`` keeps them) and the template above."""
    tokenizer = build_demo_tokenizer(EXTRA_CHARACTERS)
    tokenizer.add_tokens([TOOL_CALL, TOOL_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def problems(split: str, n: int) -> list[tuple[int, int]]:
    """``n`` problems a * b, a and b in 100..999; train and eval draw from disjoint halves of the pairs, split by
    a hash so that no pattern of the digits tells the halves apart (a split by parity once taught the model that
    every result is even: docs/agents.md, "Why the demo changed")."""
    rng = random.Random(f"agent-demo/{split}")
    picked = []
    while len(picked) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if in_train_half(a, b) == (split == "train"):
            picked.append((a, b))
    return picked


def in_train_half(a: int, b: int) -> bool:
    return hashlib.blake2b(f"{a},{b}".encode(), digest_size=1).digest()[0] < 128


def tool_call(a: int, b: int) -> str:
    return TOOL_CALL + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":")) + TOOL_END


def sft_rows(n: int = SFT_SAMPLES, seed: int = 0) -> list[dict]:
    """Conversations: ``TOOL_SHARE`` of them call ``multiply`` and copy its result, the others answer at once."""
    rng = random.Random(f"agent-demo-sft/{seed}")
    rows = []
    for a, b in problems("train", n):
        messages = [{"role": "system", "content": "tools multiply"}, {"role": "user", "content": f"{a}*{b}="}]
        if rng.random() < TOOL_SHARE:
            messages += [{"role": "assistant", "content": tool_call(a, b)}, {"role": "tool", "content": str(a * b)}]
        messages.append({"role": "assistant", "content": str(a * b)})
        rows.append({"messages": messages})
    return rows


def prompt_rows(split: str, n: int) -> list[dict]:
    return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in problems(split, n)]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def cache_folder(seed: int) -> Path:
    """Where the demo's files for ``seed`` are cached: named by a digest of this recipe and the package's code."""
    return cache_root() / f"agent_demo-{code_key(Path(__file__))}-seed{seed}"


def prepare(seed: int) -> tuple[dict[str, str], list[str] | None]:
    """The demo's files, built once per recipe and seed (cached like the other demos): the SFT model, the RL and
    held-out prompts, and the tools file; and, while the SFT model is missing, the ``openpack train_sft`` arguments
    that train it (the command runs them: ``config/commands.with_agent_demo``)."""
    from openpack.models.loading import quiet_progress_bars
    from openpack.models.tiny import tiny_causal_lm

    root = cache_folder(seed)
    files = {"tools": str(root / "tools.py"), "prompts": str(root / "prompts.jsonl"),
             "eval": str(root / "eval.jsonl"), "model": str(root / "sft" / "model")}
    if (root / "sft" / "model" / "config.json").exists():
        return files, None
    tokenizer = build_agent_tokenizer()
    base = root / "base"
    model = tiny_causal_lm("llama", seed=seed, vocab_size=len(tokenizer),
                           **{**DEMO_MODEL, "max_position_embeddings": MAX_POSITIONS})
    quiet_progress_bars()  # no "Writing model shards" bar in a pipe
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    (root / "tools.py").write_text(TOOLS_FILE)
    _write_jsonl(root / "prompts.jsonl", prompt_rows("train", PROMPTS))
    _write_jsonl(root / "eval.jsonl", prompt_rows("eval", EVAL_PROBLEMS))
    sft_data = _write_jsonl(root / "sft_data.jsonl", sft_rows(seed=seed))
    return files, ["--pretrain", str(base), "--dataset", sft_data, "--save_path", str(root / "sft"), "--overwrite",
                   "--seed", str(seed), "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "2048",
                   "--max_len", str(MAX_POSITIONS), "--train_batch_size", "64", "--max_epochs", "6",
                   "--learning_rate", "0.001", "--lr_scheduler", "cosine", "--lr_warmup_ratio", "0.06",
                   "--min_lr_ratio", "0.1", "--weight_decay", "0.01", "--adam_betas", "0.9", "0.98",
                   "--logging_steps", "20"]
