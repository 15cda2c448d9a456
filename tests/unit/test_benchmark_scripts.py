"""The openpack-vs-TRL benchmarks run end to end in their --smoke mode and report what the docs table needs.

Each script is run as a user would (a subprocess, ``--smoke``: a tiny model,
vocab and data, one repeat), writing into a tmp folder and a tmp markdown
file, never into docs/. On 2 cores: ~35 s (DPO), ~45 s (SFT), ~15 s (reward
models) and ~9 s (log-probs), almost all of it the start-up of the fresh
process every arm runs in (torch, transformers, DeepSpeed or TRL imports),
hence the slow mark.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import HANG_S

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_smoke(script: str, tmp_path: Path) -> tuple[dict, str]:
    """Run ``benchmarks/<script> --smoke``; its results.json and the markdown section it wrote."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Kept section\n\nuntouched\n")
    cmd = [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(tmp_path / "work"),
           "--markdown", str(doc)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Kept section\n\nuntouched\n")  # other sections are kept
    name = script.removesuffix(".py")
    assert f"<!-- {name}:begin -->" in text and f"<!-- {name}:end -->" in text
    assert (tmp_path / "img" / f"{name}.png").stat().st_size > 0
    return json.loads((tmp_path / "work" / "results.json").read_text()), text


def assert_spread(values, arms):
    """One positive number per repeat for every arm."""
    assert set(values) == set(arms)
    for arm in arms:
        assert len(values[arm]) == 1 and values[arm][0] > 0, (arm, values[arm])


@pytest.mark.slow
def test_dpo_vs_trl_smoke(tmp_path):
    results, text = run_smoke("dpo_vs_trl.py", tmp_path)
    summary = results["summary"]
    for key in ("tokens_per_s", "pairs_per_s", "step_time_s", "peak_rss_mb"):
        assert_spread(summary[key], ["openpack", "TRL"])
    assert len(summary["speedup"]) == 1 and summary["speedup"][0] > 0
    assert summary["trl_computed_per_real"] > 1  # TRL pads; the data has varied lengths
    # Same weights and the same first batch: TRL's and openpack's step-1 DPO losses agree.
    assert max(summary["first_step_loss_diff"]) < 1e-4
    assert results["scale"] == 16
    assert "openpack / TRL" in text and "scale factor 16" in text


@pytest.mark.slow
def test_sft_vs_trl_smoke(tmp_path):
    results, text = run_smoke("sft_vs_trl.py", tmp_path)
    summary = results["summary"]
    arms = ["openpack", "TRL packed", "TRL padded"]
    for key in ("tokens_per_s", "samples_per_s", "step_time_s", "peak_rss_mb"):
        assert_spread(summary[key], arms)
    assert summary["per_arm"]["TRL padded"]["computed_per_real"] > 1
    assert summary["per_arm"]["TRL packed"]["computed_per_real"] == 1  # padding-free: every slot is real
    assert max(summary["first_step_loss_diff"]) < 1e-4  # openpack vs TRL padded, same rows
    assert "openpack / TRL packed" in text and "openpack / TRL padded" in text


@pytest.mark.slow
def test_rm_vs_trl_smoke(tmp_path):
    results, text = run_smoke("rm_vs_trl.py", tmp_path)
    summary = results["summary"]
    for key in ("tokens_per_s", "pairs_per_s", "step_time_s", "peak_rss_mb"):
        assert_spread(summary[key], ["openpack", "TRL"])
    assert len(summary["speedup"]) == 1 and summary["speedup"][0] > 0
    assert summary["trl_computed_per_real"] > 1  # TRL pads; the data has varied lengths
    # Same weights, value head and first batch, the reward read at each sequence's eos on both sides.
    assert max(summary["first_step_loss_diff"]) < 1e-4
    assert abs(summary["first_step_loss"]["TRL"][0] - math.log(2)) > 1e-3  # the saved head spreads the rewards
    assert results["scale"] == 16
    assert "openpack / TRL" in text and "scale factor 16" in text


@pytest.mark.slow
def test_logprob_memory_smoke(tmp_path):
    results, text = run_smoke("logprob_memory.py", tmp_path)
    (row,) = results["rows"]
    for arm in ("chunked", "full"):
        assert row[arm]["skipped"] is None
        assert row[arm]["extra_mb"][0] >= 0 and row[arm]["peak_mb"][0] > row[arm]["baseline_mb"][0] > 0
        assert row[arm]["total_s"][0] > 0
    assert len(row["memory_ratio"]) == 1 and len(row["time_ratio"]) == 1
    # Both arms computed the same log-probs (same seeded inputs).
    sums = {r["arm"]: r["logprob_sum"] for r in results["results"]}
    assert sums["chunked"] == pytest.approx(sums["full"], rel=1e-4)
    assert "| 4096 |" in text


@pytest.mark.slow
def test_gpu_mfu_smoke_on_cpu(tmp_path):
    """The GPU benchmark's code path on a tiny model on CPU: packed rows are all real tokens, padded are not."""
    doc = tmp_path / "benchmarks.md"
    cmd = [sys.executable, str(BENCHMARKS / "gpu_mfu.py"), "--smoke", "--markdown", str(doc)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split("|")[2].strip(): line.split("|") for line in doc.read_text().splitlines()
            if line.startswith("| smoke |")}
    assert set(rows) == {"packed", "padded"}
    assert rows["packed"][6].strip() == "100.0%"
    assert float(rows["padded"][6].strip().rstrip("%")) < 100


@pytest.mark.parametrize("tied", [True, False])
def test_gpu_mfu_counts_each_matmul_weight_once(tied):
    """MFU's numerator: q, k, v, o, gate, up, down per layer and the LM head, counted by hand. A tied head is the
    embedding matrix: one matmul per token, not two (counted twice until 2026-11-27: MFU 1.27x too high at 0.5B)."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    import gpu_mfu

    shape = {**gpu_mfu.SIZES["0.5b"], "tie_word_embeddings": tied}
    with torch.device("meta"):
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **shape))
    h, i, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    expected = shape["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * i) + vocab * h
    assert gpu_mfu.matmul_params(model) == expected == 493_961_216  # Qwen2.5-0.5B's 494M, tied or not


@pytest.mark.vllm  # its 'openpack vLLM' arm
@pytest.mark.slow
def test_grpo_vs_trl_smoke(tmp_path):
    """A tiny random model, 4 prompts x 4 completions of <= 8 tokens, 2 steps: both arms run and split their step
    into generation and training; the ratios the docs quote are computed."""
    results, text = run_smoke("grpo_vs_trl.py", tmp_path)
    summary = results["summary"]["random"]
    arms = ["openpack", "openpack unshared", "openpack one row", "openpack vLLM", "TRL"]
    for key in ("step_time_s", "generation_s", "training_s", "training_tokens_per_s", "peak_rss_mb"):
        assert_spread(summary["values"][key], arms)
        for arm in arms[:4]:
            assert len(summary["ratios"][arm][key]) == 1 and summary["ratios"][arm][key][0] > 0
    for run in results["runs"]["random"]:
        for step in run["steps"]:  # the phases are parts of the step
            assert step["generation_s"] + step["training_s"] <= step["step_time_s"] * 1.01 + 1e-3, (run["arm"], step)
    assert summary["trl_computed_per_real"] >= 1
    assert "openpack / TRL" in text and "openpack unshared / TRL" in text and "GRPOTrainer" in text
    # the arms without --max_tokens_per_gpu ran with the automatic row cap their log states, the same for all
    caps = summary["row_caps"]
    assert caps["openpack one row"] == [16384]
    assert caps["openpack"] == caps["openpack unshared"] == caps["openpack vLLM"] and 0 < caps["openpack"][0] <= 16384
    assert (tmp_path / "img" / "grpo_vs_trl_split.png").stat().st_size > 0  # seconds per step by phase, per arm
    assert "img/grpo_vs_trl_split.png" in text


def test_grpo_vs_trl_long_prompts_are_few_shot_lines_then_the_question():
    """--workload long: every prompt is exactly 384 demo tokens (characters) and ends with its own question."""
    sys.path.insert(0, str(BENCHMARKS))
    import grpo_vs_trl

    args = grpo_vs_trl.parse_args(["--workload", "long", "--markdown", "none"])
    assert (args.models, args.prompts_per_step, args.max_completion, args.prompt_tokens) == (["random"], 8, 64, 384)
    prompt = grpo_vs_trl.few_shot_prompt("07+46=", args.prompt_tokens, seed=3)
    assert len(prompt) == 384 and prompt.endswith("\n07+46=")
    lines = prompt.split("\n")[1:-1]  # the first may be cut at the front
    assert lines and all(int(a) + int(b) == int(c) for a, b, c in (re.split("[+=]", line) for line in lines))


def test_grpo_vs_trl_runs_a_subset_of_arms_without_a_docs_section(monkeypatch):
    """--arms openpack: the default arm and TRL only (the ~100M model's run); a docs section needs every arm."""
    sys.path.insert(0, str(BENCHMARKS))
    import grpo_vs_trl

    monkeypatch.setattr(grpo_vs_trl, "OPENPACK_ARMS", grpo_vs_trl.OPENPACK_ARMS)
    monkeypatch.setattr(grpo_vs_trl, "ARMS", grpo_vs_trl.ARMS)
    with pytest.raises(SystemExit):
        grpo_vs_trl.parse_args(["--workload", "long", "--arms", "openpack"])  # would write docs/benchmarks.md
    with pytest.raises(SystemExit):
        grpo_vs_trl.parse_args(["--arms", "openpack nope", "--markdown", "none"])
    grpo_vs_trl.parse_args(["--workload", "long", "--models", "big", "--arms", "openpack", "--markdown", "none"])
    assert grpo_vs_trl.ARMS == ("openpack", "TRL") and grpo_vs_trl.OPENPACK_ARMS == ("openpack",)


@pytest.mark.slow
def test_prefix_sharing_smoke(tmp_path):
    """All four arms run on a tiny model; prefix sharing computes fewer tokens and gives the same losses, and
    step 1 (LoRA's adapters start at zero; TRL trains the same pairs) gives one loss in every arm."""
    results, text = run_smoke("prefix_sharing.py", tmp_path)
    summary = results["summary"]
    arms = ["unshared", "prefix_sharing", "prefix_sharing+lora", "trl"]
    for key in ("step_time_s", "peak_rss_mb"):
        assert_spread(summary[key], arms)
    assert summary["token_reduction"] > 0.1 and summary["max_loss_diff"] < 1e-4
    assert max(summary["first_step_loss_diff"].values()) < 1e-4
    assert summary["positions_per_step"]["trl"] > summary["tokens_per_step"]["trl"]  # TRL pads
    for ratio in ("time_reduction", "lora_rss_ratio", "lora_time_ratio"):
        assert len(summary[ratio]) == 1
    assert "prefix_sharing+lora" in text and "issue's target" in text


@pytest.mark.slow
def test_rl_prefix_sharing_smoke():
    """benchmarks/rl_prefix_sharing.py --smoke: both arms run one pass, and sharing computes fewer tokens."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "rl_prefix_sharing.py"), "--smoke"], capture_output=True,
                            text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): int(line.split("|")[2]) for line in result.stdout.splitlines()
            if line.startswith("| unshared") or line.startswith("| prefix_sharing")}
    assert rows["prefix_sharing"] < rows["unshared"]


@pytest.mark.slow
def test_rl_prefix_sharing_rss_smoke():
    """--rss: each arm's pass in a process of its own, a peak for each; the memory ratio itself is the
    benchmark's (docs/benchmarks.md), not a test's."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "rl_prefix_sharing.py"), "--smoke", "--rss"],
                            capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    peaks = {line.split("|")[1].strip(): float(line.split("|")[4]) for line in result.stdout.splitlines()
             if line.startswith("| unshared") or line.startswith("| prefix_sharing")}
    assert set(peaks) == {"unshared", "prefix_sharing"} and min(peaks.values()) >= 0, result.stdout
    assert "x the unshared pass's peak memory" in result.stdout


def test_cpu_attention_smoke():
    """benchmarks/cpu_attention.py --smoke: the padded arm's outputs match the per-length path's (the script exits
    1 when any arm differs by more than 1e-4), plain and prefix-shared rows, forward and backward."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "cpu_attention.py"), "--smoke", "--no_flex"],
                            capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    passes = [line.split("|")[4].strip() for line in result.stdout.splitlines() if line.startswith("| smoke")]
    assert passes == ["fwd", "fwd + bwd"] * 2


def test_rl_async_passes_flags_after_the_separator_to_both_arms():
    """benchmarks/rl_async.py ... -- FLAGS: another workload, the same FLAGS in the sync and the async arm."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import rl_async
    finally:
        sys.path.remove(str(BENCHMARKS))
    args = rl_async.parse_args(["--steps", "2", "--", "--generate_max_len", "32", "--temperature", "2.0"])
    assert args.steps == 2 and args.extra == ["--generate_max_len", "32", "--temperature", "2.0"]
    assert rl_async.parse_args([]).extra == []


@pytest.mark.slow
def test_context_parallel_smoke(tmp_path):
    """benchmarks/context_parallel.py --smoke (a tiny model, a row of 256 tokens): both arms train the same step
    (loss and grad norm), each rank reports its memory, and a cap of 1 MiB stops every probe at start-up through
    the watchdog (the other rank, waiting on a collective, is ended too): nothing fits. About 2 minutes on a busy
    2-core machine, nearly all of it 6 runs' start-up (each rank a fresh process)."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Kept section\n\nuntouched\n")
    cmd = [sys.executable, str(BENCHMARKS / "context_parallel.py"), "--smoke", "--cap_mb", "1", "--out",
           str(tmp_path / "work"), "--markdown", str(doc)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    runs = {(r["length"], r["arm"]): r for r in results["runs"]}
    assert set(runs) == {(256, "1 rank"), (256, "ring 2")}
    one, two = runs[256, "1 rank"], runs[256, "ring 2"]
    assert abs(one["loss"] - two["loss"]) < 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-4
    assert len(one["memory"]) == 1 and len(two["memory"]) == 2
    assert all(r["step_mb"] >= 0 and r["peak_mb"] > r["baseline_mb"] > 0 for r in one["memory"] + two["memory"])
    for arm in ("1 rank", "ring 2"):
        assert results["cap"][arm]["longest"] == 0 and results["cap"][arm]["probes"] == [
            {"length": 128, "fits": False, "peak_mb": None}]
    assert max(r["worst"] for r in results["balance"]) < 1.1  # the zigzag's balance, issue 40's target
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Kept section\n\nuntouched\n")
    assert "<!-- context_parallel:begin -->" in text and "nothing fits on 1 rank" in text
    assert (tmp_path / "img" / "context_parallel.png").stat().st_size > 0
    again = tmp_path / "again.md"  # --render: the same section from results.json alone, nothing measured
    rendered = subprocess.run([sys.executable, str(BENCHMARKS / "context_parallel.py"), "--render",
                               str(tmp_path / "work" / "results.json"), "--markdown", str(again)],
                              capture_output=True, text=True, timeout=HANG_S, check=False)
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    section = text[text.index("<!-- context_parallel:begin -->"):]
    assert again.read_text().endswith(section)


def test_context_parallel_bisection_finds_the_longest_length_that_fits():
    """benchmarks/context_parallel.py's search: from the sweep's known points, or doubling when all fit, to the
    longest multiple of the step under the cap, probing only lengths not yet known."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import context_parallel
    finally:
        sys.path.remove(str(BENCHMARKS))
    probed = []

    def fits(length):
        probed.append(length)
        return length <= 5000

    assert context_parallel.bisect_longest(fits, {4096: True, 8192: False}, 256) == (4864, 5120)
    assert probed == [6144, 5120, 4608, 4864]
    probed.clear()
    assert context_parallel.bisect_longest(fits, {}, 1024) == (4096, 5120)
    assert probed == [1024, 2048, 4096, 8192, 6144, 5120]
    assert context_parallel.bisect_longest(lambda length: False, {256: False}, 128) == (0, 128)  # nothing fits
