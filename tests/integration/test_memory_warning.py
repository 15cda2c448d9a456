"""A run whose micro-batch cannot fit this device says so before its first step (issue 12: an OOM kill, no message)."""

import logging


def test_a_run_warns_before_its_first_step(tmp_path, monkeypatch, caplog, tiny_pretrain, sft_jsonl):
    """The worker checks its budget (here: this machine made to look like it has 1 MiB) before training."""
    from openpack.cli import train_sft
    from openpack.models import memory

    monkeypatch.setattr(memory, "device_memory", lambda device, ranks: 1 << 20)
    with caplog.at_level(logging.WARNING, logger="openpack"):
        assert train_sft.main(["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(tmp_path),
                               "--launcher", "local", "--train_batch_size", "8", "--max_steps", "1",
                               "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128",
                               "--max_len", "64"]) == 0
    warnings = [r.message for r in caplog.records if r.message.startswith("memory:")]
    assert len(warnings) == 1 and "--max_tokens_per_gpu 128 needs about" in warnings[0], caplog.text
