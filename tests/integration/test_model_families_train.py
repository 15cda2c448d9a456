"""The families that needed work to pack exactly (issue 28) train: packed steps equal padded steps.

Two SFT steps of 8 samples, packed into dynamic rows against padded micro-batches of one sample, must give the
same losses, grad norms and weights to 1e-5 in fp32 (as tests/integration/test_train_sft.py for Llama). The
samples are 12 to 90 tokens, past the 8-token windows and the 32-token original context of Phi-3's longrope, so
rows mix rope regimes. Qwen3-MoE and Mixtral are in tests/unit/test_moe_aux_loss.py (their router loss is
per micro-batch, so layouts differ by design).
"""

import pytest

from openpack.cli import train_sft

from saved_runs import BARE_PROMPTS, assert_same_run, save_tiny_llama

# --adam_epsilon 1e-6, as in tests/integration/test_train_dpo.py: AdamW moves a weight by lr * g / (|g| + eps), so
# with eps 1e-8 a weight whose gradient is float noise moves by a noise-sized share of lr. On a Zen 3 EPYC
# (2026-11-27) one of GPT-NeoX's 8192 dense_4h_to_h weights ended 1.9e-5 apart (0.019 lr) between the layouts,
# which sum that gradient in other orders, while every loss and grad norm agreed to 1e-5. A larger eps keeps the
# weight check about the gradients the layouts compute.
COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
          "--lr_scheduler", "constant", "--max_len", "96", "--seed", "1", "--max_norm", "100", "--launcher", "local",
          "--adam_epsilon", "1e-6", *BARE_PROMPTS]
PACKED = ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "192"]
PADDED = ["--micro_train_batch_size", "1"]


@pytest.mark.parametrize("family", ["gemma2", "gpt_neox", "phi3_longrope"])
def test_packed_steps_equal_padded_steps(family, tmp_path, sft_jsonl):
    pretrain = save_tiny_llama(tmp_path / "model", seed=2, arch=family)
    runs = {}
    for name, layout in (("packed", PACKED), ("padded", PADDED)):
        argv = ["--pretrain", pretrain, "--dataset", sft_jsonl, "--save_path", str(tmp_path / name), *COMMON, *layout]
        assert train_sft.main(argv) == 0
        runs[name] = tmp_path / name
    assert_same_run(runs["packed"], runs["padded"])
