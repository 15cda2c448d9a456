"""The GPU runbook stays runnable on a machine without a GPU (issue 43): its full-trainer section's dry run, and the
wheels a GPU call carries.

The dry run is the GPU run's code on tiny Qwen2 models (lengths of the ANCHORS mix divided by 8, ``--bf16`` on the
CPU): every command through the CLI, the fp32 step-1 losses beside them, one resume per kind of checkpoint, the
DPO overhead arms (the kernel-level harness and TRL's DPOTrainer) and the DPO step under the profiler. About 4
minutes on 2 cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpu_full_trainer as ft  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["dpo", "sft", "dpo_prefix", "rm", "grpo", "ppo", "lora", "dpo_zero3", "sft_gc"]
# the first command of each kind of checkpoint resumes in a dry run
RESUMED = {"dpo": "ZeRO-2", "grpo": "policy", "ppo": "policy and critic", "lora": "LoRA adapters",
           "dpo_zero3": "ZeRO-3"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runbook")
    run = subprocess.run([sys.executable, "examples/gpu_runbook.py", "--dry-run", "--out", str(out), "--sections",
                          "full_trainer", "--profile"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "verification_block.md").read_text()


def test_every_command_runs_through_the_cli(dry_run):
    results, block = dry_run
    assert [r["name"] for r in results["full_trainer"]] == COMMANDS
    assert {r["name"]: r["exit"] for r in results["full_trainer"]} == dict.fromkeys(COMMANDS, 0)
    assert all(r["tokens_per_s"] > 0 and r["checkpoint_gib"] > 0 for r in results["full_trainer"])
    assert "The full trainer" in block and "skipped" not in block


def test_step_1_losses_in_bf16_meet_the_fp32_cpu_losses(dry_run):
    """bf16 against fp32 on the same CPU, each command held to its own fp32 run (or one with the same loss: ZeRO-3
    and gradient checkpointing change no number of step 1); DPO with policy == reference is ln 2."""
    results, block = dry_run
    fp32 = {name: metrics["loss"] for name, metrics in results["full_trainer_cpu_step1"].items()}
    assert set(fp32) == {"sft", "dpo_prefix", "rm", "lora"}
    held_to = {"sft": "sft", "sft_gc": "sft", "dpo_prefix": "dpo_prefix", "dpo_zero3": "dpo_prefix", "rm": "rm",
               "lora": "lora"}
    for r in results["full_trainer"]:
        loss = r["step1"][0]["loss"]
        if r["name"] in held_to:
            ref = fp32[held_to[r["name"]]]
            assert abs(loss - ref) <= max(ft.BF16_LOSS_RTOL * abs(ref), ft.BF16_LOSS_ATOL), (r["name"], loss, ref)
            assert loss != ref  # bf16 really ran: its rounding shows
    dpo = next(r for r in results["full_trainer"] if r["name"] == "dpo")
    assert dpo["step1"][0]["loss"] == pytest.approx(ft.LN2, abs=1e-6)
    assert "OUTSIDE" not in block and "failed" not in block


def test_one_resume_of_each_checkpoint_kind_continues_at_the_saved_step(dry_run):
    results, _ = dry_run
    resumed = {r["name"]: r["resumed"] for r in results["full_trainer"]}
    assert {name: resumed[name] for name in RESUMED} == dict.fromkeys(RESUMED, "yes")
    assert all(resumed[name].startswith("not run (dry run") for name in COMMANDS if name not in RESUMED)


def test_rl_commands_report_their_rollout_against_trainer_log_probs(dry_run):
    results, block = dry_run
    for r in results["full_trainer"]:
        if r["name"] in ("grpo", "ppo"):
            assert 0 <= r["step1"][0]["vllm_logp_diff"] < 0.05, r["step1"][0]  # bf16 HF generate vs bf16 trainer
    assert block.count("rollout vs trainer log-prob gap") == 2


def test_the_dpo_overhead_table_has_the_harness_and_trl(dry_run):
    results, block = dry_run
    arms = results["dpo_overhead"]
    assert len(arms) == 3 and all(rate > 0 for rate in arms.values()), arms
    assert "benchmarks/gpu_mfu.py packed arm" in block and "TRL 1.16" in block


def test_the_trainers_dpo_step_is_profiled_by_op(dry_run):
    """``--profile``: the DPO command's step 2 under torch.profiler (examples/profile_step.py), ops in the block."""
    _, block = dry_run
    assert "profile_step: step 2 took" in block and "aten::mm" in block and "Self CPU time total" in block


def test_the_wheels_script_fetches_what_the_gpu_machine_lacks_within_the_size_limit(tmp_path):
    """Downloads from the package registry and builds DeepSpeed's pure-Python wheel, as a session does before a
    GPU call; one wheel per package, for Python 3.12."""
    run = subprocess.run(["bash", "examples/gpu_wheels.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "WHEELS": str(tmp_path / "whl")})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    names = sorted(w.name.split("-")[0].lower() for w in (tmp_path / "whl").glob("*.whl"))
    assert names == ["annotated_types", "datasets", "deepspeed", "dill", "hjson", "multiprocess", "pydantic",
                     "pydantic_core", "trl", "typing_inspection"]
    assert next((tmp_path / "whl").glob("pydantic_core-*cp312*manylinux*.whl"))
    assert "together" in run.stdout and "limit 60 MiB" in run.stdout


def test_the_context_parallel_section_checks_the_split_code_path(tmp_path):
    """``--sections context_parallel``'s dry run: benchmarks/context_parallel.py --check on CPU (fp32, SDPA, gloo), a
    split row's log-probs and gradients equal to the whole row's as a single-rank group and as 2 ranks, then one
    row's memory per rank on 1 and 2 ranks, the same step-1 loss on both (about 3 minutes on a busy 2-core machine)."""
    run = subprocess.run([sys.executable, "examples/gpu_runbook.py", "--dry-run", "--out", str(tmp_path), "--sections",
                          "context_parallel"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    check = results["context_parallel_check"]
    assert check["exit"] == 0
    assert check["split, 1 rank"]["held"] == [check["split, 1 rank"]["tokens"]]
    assert len(check["split, 2 ranks"]["held"]) == 2 and sum(check["split, 2 ranks"]["held"]) == 256
    for arm in ("split, 1 rank", "split, 2 ranks"):
        assert check[arm]["logprob_error"] < 1e-5 and check[arm]["grad_error"] < 1e-5, check[arm]
    runs = results["context_parallel_memory"]["runs"]
    assert [(r["length"], r["arm"]) for r in runs] == [(1024, "1 rank"), (1024, "ring 2")]
    assert all(r["step_mb"] > 0 for r in runs)
    one, two = runs
    assert abs(one["loss"] - two["loss"]) < 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-4
    block = (tmp_path / "verification_block.md").read_text()
    assert block.count("exact (< 1e-5)") == 2 and "DIFFERS" not in block and "Failed" not in block


def test_commands_run_in_the_order_named_and_ppo_brings_its_reward_model():
    """``--commands`` reruns what a budget cut; PPO needs train_rm's model, so ``rm`` runs just before it."""
    work = Path("/nonexistent")
    setup = ft.Setup(work, work / "policy", work / "reference", work / "sft.jsonl", work / "pairs.jsonl",
                     work / "prompts.jsonl", "reward.py:parity", 1, 1, 1, 1.0, 1.0, 1)
    every = ft.commands(setup)
    names = lambda only: [c.name for c in ft.selected(every, only)]  # noqa: E731
    assert names(None) == COMMANDS
    assert names(["ppo", "lora", "grpo"]) == ["rm", "ppo", "lora", "grpo"]
    assert names(["grpo", "rm", "ppo"]) == ["grpo", "rm", "ppo"]
    assert names(["sft_gc", "dpo"]) == ["sft_gc", "dpo"]
