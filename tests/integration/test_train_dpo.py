"""openpack train_dpo end to end on CPU: pair packing is exact, reference modes agree, bad input is named.

Two optimizer steps of 8 pairs (sigmoid + 0.5 x NLL, policy != reference):
every layout and world size must give the same per-step loss, grad norm and
final weights to 1e-5 in fp32, because the loss is the mean over the step's
pairs and the NLL the mean over the step's chosen tokens.
"""

import json
import os

import pytest

from openpack.cli import train_dpo
from openpack.distributed.process import free_port

from hang_guard import HANG_S
from saved_runs import assert_same_run, read_metrics, write_pairs

# --adam_epsilon 1e-6: AdamW moves a weight by lr * g / (|g| + eps). With eps 1e-8 one gate_proj weight whose
# gradient is float noise (|g| 3.0e-9 packed, 3.8e-9 padded: the two layouts sum in other orders) moved
# 0.23 lr vs 0.28 lr, a 4.5e-5 weight difference after 2 steps, while every loss and grad norm agreed. A
# larger eps keeps the weight check about the gradients the layouts compute, not Adam dividing noise by eps.
COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
          "--lr_scheduler", "constant", "--max_len", "48", "--seed", "1", "--max_norm", "100",
          "--loss_type", "sigmoid", "--nll_loss_coef", "0.5", "--beta", "0.5", "--adam_epsilon", "1e-6",
          "--launcher", "local"]
LAYOUTS = {
    "packed_dynamic": ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "160"],
    "padded_8x1": ["--micro_train_batch_size", "1"],
    "padded_1x8": ["--micro_train_batch_size", "8"],
}


def dpo(save_path, pretrain, reference, dataset, *flags):
    argv = ["--pretrain", pretrain, "--ref_pretrain", reference, "--dataset", dataset, "--save_path", str(save_path),
            *COMMON, *flags]
    assert train_dpo.main(argv) == 0
    return save_path


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_pretrain, tiny_reference, dpo_jsonl):
    return dpo(tmp_path_factory.mktemp("dpo_ref"), tiny_pretrain, tiny_reference, dpo_jsonl, *LAYOUTS["packed_dynamic"])


@pytest.mark.parametrize("layout", ["padded_8x1", "padded_1x8"])
def test_layouts_give_the_same_steps(layout, reference_run, tmp_path, tiny_pretrain, tiny_reference, dpo_jsonl):
    assert_same_run(dpo(tmp_path / layout, tiny_pretrain, tiny_reference, dpo_jsonl, *LAYOUTS[layout]), reference_run)


def test_prefix_sharing_gives_the_same_steps(reference_run, tmp_path, tiny_pretrain, tiny_reference, dpo_jsonl):
    """One group prompt | chosen | rejected per pair (the prompt computed once; some pairs cut to --max_len 48):
    fewer tokens per step, the same losses (with the NLL term's chosen-token count), grad norms and weights."""
    flags = [*LAYOUTS["packed_dynamic"], "--prefix_sharing"]
    shared = dpo(tmp_path / "shared", tiny_pretrain, tiny_reference, dpo_jsonl, *flags)
    assert_same_run(shared, reference_run)
    assert all(s["tokens"] < u["tokens"] for s, u in zip(read_metrics(shared), read_metrics(reference_run)))


@pytest.mark.parametrize("layout", ["packed_dynamic", "padded_1x8", "prefix_sharing", "zero3"])
def test_fused_loss_gives_the_same_steps(layout, reference_run, tmp_path, tiny_pretrain, tiny_reference, dpo_jsonl,
                                         monkeypatch):
    """--fused_loss (head, loss and gradients in one pass) == the chunked log-probs, in every layout. Chunks of
    at most 5 label tokens: every pair is over that, so each chunk is one whole pair and the step has many."""
    monkeypatch.setattr("openpack.core.fused_loss.default_chunk_tokens", lambda vocab: 5)
    flags = {"packed_dynamic": LAYOUTS["packed_dynamic"], "padded_1x8": LAYOUTS["padded_1x8"],
             "prefix_sharing": [*LAYOUTS["packed_dynamic"], "--prefix_sharing"],
             "zero3": [*LAYOUTS["packed_dynamic"], "--zero_stage", "3"]}[layout]
    assert_same_run(dpo(tmp_path / layout, tiny_pretrain, tiny_reference, dpo_jsonl, *flags, "--fused_loss"),
                    reference_run)


def test_fused_loss_with_lora_gives_the_same_steps(tmp_path, tiny_pretrain, dpo_jsonl, monkeypatch):
    """LoRA freezes the head, so the fused path builds no head gradient; the adapters' steps are the same."""
    monkeypatch.setattr("openpack.core.fused_loss.default_chunk_tokens", lambda vocab: 5)
    flags = [*LAYOUTS["packed_dynamic"], "--lora_rank", "4", "--lora_alpha", "8"]
    runs = [dpo(tmp_path / name, tiny_pretrain, tiny_pretrain, dpo_jsonl, *flags, *extra)
            for name, extra in (("chunked", []), ("fused", ["--fused_loss"]))]
    assert_same_run(*runs)


def test_prefix_sharing_needs_packing(tmp_path, tiny_pretrain, dpo_jsonl, capsys):
    argv = ["--pretrain", tiny_pretrain, "--dataset", dpo_jsonl, "--save_path", str(tmp_path), "--prefix_sharing"]
    assert train_dpo.main(argv) == 2
    assert "add --packing_samples" in capsys.readouterr().err


def test_pairs_are_packed_and_metrics_named_as_trl(reference_run):
    for m in read_metrics(reference_run):
        assert m["pairs"] == 8 and m["micro_batches"] < 8 and 0 < m["packing_efficiency"] <= 1
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                    "logps/chosen", "logps/rejected", "tokens_per_s", "pairs_per_s"):
            assert key in m
        assert m["rewards/margins"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"], abs=1e-6)


@pytest.mark.slow
def test_two_ranks_equal_one_rank(reference_run, tmp_path, tiny_pretrain, tiny_reference, dpo_jsonl):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_dpo", "--pretrain", tiny_pretrain, "--ref_pretrain", tiny_reference,
           "--dataset", dpo_jsonl, "--save_path", str(tmp_path / "two"), *COMMON[:-2], *LAYOUTS["packed_dynamic"]]
    assert COMMON[-2:] == ["--launcher", "local"]  # left out: under torchrun each process is a rank whatever --launcher says
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(tmp_path / "two", reference_run)


def test_cached_reference_equals_colocated_and_is_reused(reference_run, tmp_path, tiny_pretrain, tiny_reference, dpo_jsonl):
    cache = tmp_path / "ref_logps.pt"
    flags = [*LAYOUTS["packed_dynamic"], "--ref_logps_cache", str(cache)]
    assert_same_run(dpo(tmp_path / "first", tiny_pretrain, tiny_reference, dpo_jsonl, *flags), reference_run)
    written = cache.stat().st_mtime_ns
    assert_same_run(dpo(tmp_path / "second", tiny_pretrain, tiny_reference, dpo_jsonl, *flags), reference_run)
    assert cache.stat().st_mtime_ns == written  # reused, not recomputed


def test_a_cache_of_other_data_is_refused(tmp_path, tiny_pretrain, tiny_reference, dpo_jsonl, capsys):
    cache = tmp_path / "ref_logps.pt"
    flags = [*COMMON, *LAYOUTS["packed_dynamic"], "--ref_logps_cache", str(cache), "--max_steps", "1"]
    dpo(tmp_path / "a", tiny_pretrain, tiny_reference, dpo_jsonl, *flags)
    other = write_pairs(tmp_path / "other.jsonl", seed=9)
    argv = ["--pretrain", tiny_pretrain, "--ref_pretrain", tiny_reference, "--dataset", other,
            "--save_path", str(tmp_path / "b"), *flags]
    assert train_dpo.main(argv) == 2
    assert "another reference model or dataset" in capsys.readouterr().err


def test_reference_free_loss_and_ipo_alias(tmp_path, tiny_pretrain, dpo_jsonl):
    argv = ["--pretrain", tiny_pretrain, "--dataset", dpo_jsonl, *COMMON, *LAYOUTS["packed_dynamic"]]
    assert train_dpo.main([*argv, "--save_path", str(tmp_path / "simpo"), "--loss_type", "simpo", "--nll_loss_coef", "0"]) == 0
    assert all(m["loss"] > 0 for m in read_metrics(tmp_path / "simpo"))
    assert train_dpo.main([*argv, "--save_path", str(tmp_path / "ipo"), "--ipo"]) == 0
    assert "- ipo" in (tmp_path / "ipo" / "config.yaml").read_text()


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("row,message", [
    ({"prompt": "ab", "chosen": "ba", "rejected": "ba"}, "pairs.jsonl:1"),
    ({"prompt": "ab", "chosen": "ba"}, "--rejected_key"),
    ({"prompt": "ab" * 40, "chosen": "ba", "rejected": "bb"}, "--max_len"),
])
def test_bad_pairs_are_named(row, message, tmp_path, tiny_pretrain, capsys):
    data = write_rows(tmp_path / "pairs.jsonl", [row])
    argv = ["--pretrain", tiny_pretrain, "--dataset", data, "--save_path", str(tmp_path / "out"),
            "--train_batch_size", "1", "--max_len", "48", "--overlength_policy", "error", "--launcher", "local"]
    assert train_dpo.main(argv) == 2
    assert message in capsys.readouterr().err
