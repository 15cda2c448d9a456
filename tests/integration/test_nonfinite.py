"""Non-finite steps (``distributed/nonfinite.py``): skipped on every rank, counted, three in a row stop the run with
one line and exit 1; nothing non-finite is ever saved; metrics.jsonl stays strict JSON.

The invariant: a run whose step 2 had one inf in one rank's loss ends equal (1e-5) to a run that never had step 2.
Its warm-up spans the skipped step (2 warm-up steps of 4, and of 3), so a scheduler that moved on for the skip, or an
AdamW step count that did, would change every later update.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import openpack.rl.update
import openpack.trainers.sft_worker
from openpack.cli import train_dpo, train_grpo, train_sft
from openpack.core.batch import collate_packed
from openpack.distributed.engine import ChunkedAdamW, OptimConfig, ZeroConfig, create_engine, optimizer_step
from openpack.distributed.process import free_port, init_distributed
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.models.verify import random_segments

from hang_guard import HANG_S
from saved_runs import BARE_PROMPTS, load_weights, read_metrics, write_pairs

ABSURD = ["--learning_rate", "1e30", "--max_steps", "8", "--save_steps", "1", "--train_batch_size", "8",
          "--micro_train_batch_size", "4", "--max_len", "64", "--seed", "1", "--launcher", "local", *BARE_PROMPTS]


def assert_nothing_nonfinite_saved(run: Path):
    """Every tensor of every checkpoint (DeepSpeed's files and the HF folder) is finite, and no final model."""
    from safetensors.torch import load_file

    assert not (run / "model").exists()
    checkpoints = sorted((run / "checkpoints").glob("global_step*"))
    assert checkpoints, "the steps before the divergence were checkpointed"
    for folder in checkpoints:
        tensors = dict(load_file(folder / "hf_model" / "model.safetensors"))
        for path in folder.rglob("*.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            tensors.update({f"{path.name}:{k}": v for k, v in _tensors(state)})
        for name, tensor in tensors.items():
            assert torch.isfinite(tensor).all(), (folder.name, name)
    assert (run / "checkpoints" / (run / "checkpoints" / "latest").read_text()).is_dir()


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        if state.is_floating_point():
            yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{prefix}.{i}")


def assert_stopped_with_one_line(code: int, err: str, command: str):
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith(f"openpack {command}:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert "3 steps in a row had a non-finite loss or gradient norm" in line and "--max_nonfinite_steps 3" in line
    assert "--learning_rate" in line and "--max_norm" in line and "--bf16" in line and "the samples of step" in line


def test_a_diverging_sft_run_stops_and_saves_nothing_nonfinite(tmp_path, tiny_pretrain, sft_jsonl, capsys):
    run = tmp_path / "sft"
    code = train_sft.main(["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(run), *ABSURD])
    out, err = capsys.readouterr()
    assert_stopped_with_one_line(code, err, "train_sft")
    assert "not finite, the update is skipped on every rank (1 in a row" in out, out
    assert_nothing_nonfinite_saved(run)
    metrics = read_metrics(run)  # strict JSON
    skipped = [m for m in metrics if m["skipped_steps"]]
    assert [m["skipped_steps"] for m in skipped] == [1, 2]  # the third stops the run before it is logged
    assert all(m["grad_norm"] is None or m["loss"] is None for m in skipped), skipped  # non-finite: null


def test_a_diverging_dpo_run_stops_and_saves_nothing_nonfinite(tmp_path, tiny_pretrain, tiny_reference, capsys):
    run = tmp_path / "dpo"
    dataset = write_pairs(tmp_path / "pairs.jsonl")
    code = train_dpo.main(["--pretrain", tiny_pretrain, "--ref_pretrain", tiny_reference, "--dataset", dataset,
                           "--save_path", str(run), *ABSURD])
    _, err = capsys.readouterr()
    assert_stopped_with_one_line(code, err, "train_dpo")
    assert_nothing_nonfinite_saved(run)
    read_metrics(run)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_skipped_step_changes_nothing_at_any_zero_stage(stage):
    """Each DeepSpeed path (stage 0: our AdamW alone; ZeRO-2 and ZeRO-3: DeepSpeed's optimizers around it): a step
    with a NaN loss leaves AdamW's weights (ZeRO's fp32 master), moments, step count and the learning rate as they
    were; the next finite step is applied."""
    dist = init_distributed()
    optim = OptimConfig(1e-3, 0.0, (0.9, 0.95), "linear", 2, 10, 0.1, 100.0)
    engine = create_engine(PackedCausalLM(tiny_causal_lm("qwen2", seed=5)), optim,
                           ZeroConfig(stage, False, False, False, param_persistence_threshold=0), 1)
    inner = engine.optimizer if isinstance(engine.optimizer, ChunkedAdamW) else engine.optimizer.optimizer
    batch = collate_packed(random_segments([5, 9, 3], 256, 0)).to(dist.device)

    def step(poison: bool):
        engine.set_gradient_accumulation_boundary(True)
        loss = -engine(batch).sum() / 14
        engine.backward(loss)
        optimizer_step(engine, loss.detach() * (float("nan") if poison else 1.0))

    def state():  # ZeRO-3 hands AdamW its fp32 partitions one sub-group at a time: read them where they are kept
        weights = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [
            p for group in inner.param_groups for p in group["params"]]
        return [engine.get_lr()[0]] + [t.detach().clone() for p in weights for t in (p, *inner.state[p].values())]

    step(False)
    before = state()
    assert len(before) > 3  # weights, moments and step counts were read
    step(True)
    after = state()
    assert engine.step_guard.skipped == 1 and after[0] == before[0]
    for x, y in zip(after[1:], before[1:]):
        assert torch.equal(x, y)
    step(False)
    assert engine.step_guard.skipped == 1 and engine.get_lr()[0] != before[0]
    assert not torch.equal(state()[1], before[1])


INJECTED = ["--train_batch_size", "8", "--max_steps", "4", "--learning_rate", "1e-3", "--lr_scheduler", "constant",
            "--lr_warmup_ratio", "0.5", "--max_len", "64", "--seed", "1", "--max_norm", "100",
            "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128", *BARE_PROMPTS]


@pytest.mark.slow
def test_one_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path, tiny_pretrain, sft_jsonl, monkeypatch):
    """Two ranks (real ZeRO-2: DeepSpeed's optimizer, our guard in its inner AdamW), rank 1's loss inf in step 2
    == one rank that was never planned step 2 (1 rank == 2 ranks holds to 1e-5: test_train_sft.py)."""
    injected = tmp_path / "injected"
    script = Path(__file__).with_name("nonfinite_script.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), "2", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(injected),
           *INJECTED]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step 2: loss nan" in result.stdout and "skipped on every rank (1 in a row, 1 in all" in result.stdout

    plan_ranks = openpack.trainers.sft_worker.plan_ranks

    def without_step_2(*args, **kwargs):
        plans = plan_ranks(*args, **kwargs)
        for plan in plans:
            del plan.steps[1]
        return plans

    monkeypatch.setattr(openpack.trainers.sft_worker, "plan_ranks", without_step_2)
    never = tmp_path / "never"
    assert train_sft.main(["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(never),
                           "--launcher", "local", *INJECTED]) == 0
    got, want = read_metrics(injected), read_metrics(never)
    assert got[1]["loss"] is None and [m["skipped_steps"] for m in got] == [0, 1, 1, 1]
    for x, y in zip(got[:1] + got[2:], want):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5) and x["lr"] == y["lr"], (x, y)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x, y)
    for name, weight in load_weights(never).items():
        torch.testing.assert_close(load_weights(injected)[name], weight, atol=1e-5, rtol=0, msg=name)


GRPO = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "2",
        "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
        "--max_steps", "2", "--rollout_backend", "hf", "--launcher", "local"]


def test_a_grpo_policy_with_nan_logprobs_for_one_step(tmp_path, rl_model, capsys, monkeypatch):
    """The policy's log-probs are NaN in its 3rd optimizer step (of 4 a rollout batch): that update is skipped,
    counted and said; the run goes on and saves a finite model."""
    policy_step, taken = openpack.rl.update.policy_step, {"steps": 0}

    def nan_once(engine, *args, **kwargs):
        taken["steps"] += 1
        if taken["steps"] == 3:
            forward = engine.forward
            engine.forward = lambda *a, **k: forward(*a, **k) * float("nan")
            try:
                return policy_step(engine, *args, **kwargs)
            finally:
                del engine.forward
        return policy_step(engine, *args, **kwargs)

    monkeypatch.setattr(openpack.rl.update, "policy_step", nan_once)
    run = tmp_path / "grpo"
    assert train_grpo.main(["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
                            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(run), *GRPO]) == 0
    out = capsys.readouterr().out
    assert "policy step 3: loss nan" in out and "(1 in a row, 1 in all; the last finite loss was" in out, out
    metrics = [m for m in read_metrics(run) if "policy_loss" in m]
    assert [m["skipped_steps"] for m in metrics] == [1, 1]
    assert metrics[0]["policy_loss"] is None and metrics[1]["policy_loss"] is not None
    for name, weight in load_weights(run).items():
        assert torch.isfinite(weight).all(), name


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train_sft", "train_dpo"])
def test_the_demos_at_an_absurd_learning_rate_stop_and_save_nothing_nonfinite(command, tmp_path, capsys):
    """The built-in demos as a user runs them (no --pretrain: the demo model and data; DPO from the cached SFT demo
    model), at a learning rate of 1e30: exit 1, one line, no non-finite tensor saved, no final model."""
    main = {"train_sft": train_sft.main, "train_dpo": train_dpo.main}[command]
    run = tmp_path / command
    code = main(["--learning_rate", "1e30", "--max_steps", "8", "--save_steps", "1", "--launcher", "local",
                 "--save_path", str(run)])
    _, err = capsys.readouterr()
    assert_stopped_with_one_line(code, err, command)
    assert_nothing_nonfinite_saved(run)
    read_metrics(run)
