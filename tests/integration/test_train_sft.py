"""openpack train_sft end to end on CPU: exact-normalisation invariances, resume, checkpoints.

Two optimizer steps of 8 samples each; every layout must give the same
per-step loss, grad norm and final weights to 1e-5 in fp32, because the loss
is the mean over the step's tokens whatever the micro-batching.

Adam's epsilon is 1e-6 here, not the default 1e-8: Adam divides each gradient
by its own root mean square, so a weight whose gradient sums to nearly zero
moves by up to lr / eps times the gradient's rounding error (1e5 at the
default). Layouts sum a step's gradient in another order, and on a Xeon with
AVX-512/AMX kernels (2026-11-29) that put one weight of 8192 1.7e-5 apart
after two steps, with losses and grad norms equal to 1e-7; at eps 1e-6 every
layout's weights agree to 7e-7. The loss is still compared to 1e-5, and a
normalisation bug moves far more than rounding.
"""

import os
import shutil
import subprocess
import sys

import pytest

from openpack.cli import train_sft
from openpack.distributed.process import free_port

from hang_guard import HANG_S
from saved_runs import assert_same_run, read_metrics

COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
          "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100", "--adam_epsilon", "1e-6",
          "--launcher", "local"]

LAYOUTS = {
    "packed_dynamic": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128"],
    "padded_8x1": ["--micro_train_batch_size", "1"],
    "padded_1x8": ["--micro_train_batch_size", "8"],
    "packed_rows_of_4": ["--packing_samples", "--micro_train_batch_size", "4"],
}


def sft(save_path, pretrain, dataset, *flags):
    argv = ["--pretrain", pretrain, "--dataset", dataset, "--save_path", str(save_path), *COMMON, *flags]
    assert train_sft.main(argv) == 0
    return save_path


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_pretrain, sft_jsonl):
    return sft(tmp_path_factory.mktemp("ref"), tiny_pretrain, sft_jsonl, *LAYOUTS["packed_dynamic"])


@pytest.mark.parametrize("layout", ["padded_8x1", "padded_1x8", "packed_rows_of_4"])
def test_layouts_give_the_same_steps(layout, reference_run, tmp_path, tiny_pretrain, sft_jsonl):
    run = sft(tmp_path / layout, tiny_pretrain, sft_jsonl, *LAYOUTS[layout])
    assert_same_run(run, reference_run)


@pytest.mark.parametrize("layout", ["packed_dynamic", "padded_1x8"])
def test_fused_loss_gives_the_same_steps(layout, reference_run, tmp_path, tiny_pretrain, sft_jsonl, monkeypatch):
    """--fused_loss == the chunked log-probs. Chunks of 5 label tokens, which cut samples: the NLL is linear in
    each sample's sum, so any cut is exact."""
    monkeypatch.setattr("openpack.core.fused_loss.default_chunk_tokens", lambda vocab: 5)
    run = sft(tmp_path / layout, tiny_pretrain, sft_jsonl, *LAYOUTS[layout], "--fused_loss")
    assert_same_run(run, reference_run)


def test_dynamic_batching_really_packs(reference_run):
    metrics = read_metrics(reference_run)
    assert all(m["micro_batches"] < 8 for m in metrics)  # several samples share each row
    assert all(0 < m["packing_efficiency"] <= 1 for m in metrics)
    assert [m["samples"] for m in metrics] == [8, 8]


def test_the_invariance_can_fail(tmp_path, reference_run, tiny_pretrain, sft_jsonl):
    """Guard: a different seed (other samples per step) must not pass the same comparison."""
    run = sft(tmp_path / "other", tiny_pretrain, sft_jsonl, *LAYOUTS["packed_dynamic"], "--seed", "2")
    with pytest.raises(AssertionError):
        assert_same_run(run, reference_run)


def torchrun(save_path, pretrain, dataset, *flags, nproc=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(free_port())  # torchrun's static rendezvous needs a real port; 0 hangs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port,
           "-m", "openpack.cli.main", "train_sft", "--pretrain", pretrain, "--dataset", dataset,
           "--save_path", str(save_path), *COMMON, *flags]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    return save_path


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["packed_dynamic", "padded_1x8"])
def test_two_ranks_equal_one_rank(layout, reference_run, tmp_path, tiny_pretrain, sft_jsonl):
    flags = LAYOUTS[layout] if layout != "padded_1x8" else ["--micro_train_batch_size", "4"]  # 2 ranks x 4
    run = torchrun(tmp_path / "two_ranks", tiny_pretrain, sft_jsonl, *flags)
    assert_same_run(run, reference_run)


def test_resumed_equals_uninterrupted(tmp_path, tiny_pretrain, sft_jsonl):
    """Stop after step 2 (its checkpoint is all that survives), resume, and match steps 3-4 exactly."""
    flags = [*LAYOUTS["packed_dynamic"], "--max_steps", "4", "--save_steps", "2", "--max_ckpt_num", "5"]
    full = sft(tmp_path / "full", tiny_pretrain, sft_jsonl, *flags)
    # What a run killed right after step 2 leaves behind: the step-2 checkpoint, marked latest.
    interrupted = tmp_path / "interrupted"
    ckpts = interrupted / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "global_step2", ckpts / "global_step2")
    (ckpts / "latest").write_text("global_step2")
    sft(interrupted, tiny_pretrain, sft_jsonl, *flags, "--load_checkpoint")
    resumed = read_metrics(interrupted)
    uninterrupted = read_metrics(full)
    assert [m["step"] for m in resumed] == [3, 4]
    for x, y in zip(resumed, uninterrupted[2:]):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5, (x, y)
    from saved_runs import load_weights
    import torch
    for name, w in load_weights(full).items():
        torch.testing.assert_close(load_weights(interrupted)[name], w, atol=1e-5, rtol=0, msg=name)


def test_checkpoints_are_complete_pruned_and_loadable(tmp_path, tiny_pretrain, sft_jsonl):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = sft(tmp_path / "ckpt", tiny_pretrain, sft_jsonl, *LAYOUTS["packed_dynamic"],
              "--max_steps", "3", "--save_steps", "1", "--max_ckpt_num", "2")
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("global_step*")) == ["global_step2", "global_step3"]  # pruned to 2
    assert (ckpts / "latest").read_text() == "global_step3"
    assert not list(run.rglob(".*tmp*"))  # nothing left half-written
    for folder in (ckpts / "global_step3" / "hf_model", run / "model"):
        AutoModelForCausalLM.from_pretrained(folder)
        AutoTokenizer.from_pretrained(folder)
    assert (run / "config.yaml").exists() and (run / "loss.png").exists()
    assert "packing_samples: true" in (run / "config.yaml").read_text()


@pytest.mark.parametrize("option", [
    ["--gradient_checkpointing"],
    ["--adam_offload"],
    ["--zero_stage", "3", "--param_offload", "--adam_offload"],
])
def test_memory_options_do_not_change_the_steps(option, reference_run, tmp_path, tiny_pretrain, sft_jsonl):
    """Recomputing activations and offloading to CPU trade time for memory, never numbers (fp32)."""
    run = sft(tmp_path / "option", tiny_pretrain, sft_jsonl, *LAYOUTS["packed_dynamic"], *option)
    assert_same_run(run, reference_run)


def test_bf16_follows_fp32(tmp_path, reference_run, tiny_pretrain, sft_jsonl):
    """bf16 keeps 8 mantissa bits: per-step losses within 1% of the fp32 run, but not bit-equal."""
    run = sft(tmp_path / "bf16", tiny_pretrain, sft_jsonl, *LAYOUTS["packed_dynamic"], "--bf16")
    bf16 = [m["loss"] for m in read_metrics(run)]
    fp32 = [m["loss"] for m in read_metrics(reference_run)]
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=0.01)
