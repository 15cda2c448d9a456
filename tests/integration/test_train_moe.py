"""openpack train_sft on a tiny Qwen3-MoE: the router load-balancing loss reaches DeepSpeed's gradient and the log.

Runs of one step from the same weights and samples, with the aux loss's coefficient 1.0 and 0.0 (from the config,
or from ``--aux_loss_coef``): the LM loss is the same, the grad norm is not (the aux term's gradient), and only
the first logs ``router_aux_loss``. The number
itself is checked against transformers in tests/unit/test_moe_aux_loss.py. 2.2 s once DeepSpeed's CPU op is built
(a session's first DeepSpeed run builds it: 23 s here).
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from openpack.cli import train_sft
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.models.attention import register_packed_attention

from saved_runs import BARE_PROMPTS, read_metrics

COEF = 1.0  # large, so that the aux term's share of the gradient is plain
FLAGS = ["--train_batch_size", "8", "--max_steps", "1", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
         "--max_len", "64", "--seed", "1", "--launcher", "local", "--logging_steps", "1",
         "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128", *BARE_PROMPTS]


def save_tiny_moe(path, coef: float) -> str:
    tokenizer = build_demo_tokenizer()
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, router_aux_loss_coef=coef, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation=register_packed_attention()).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_router_aux_loss_trains_and_is_logged(tmp_path, sft_jsonl):
    """Runs: the config's coefficient; --aux_loss_coef 0 over it; --aux_loss_coef over a config's 0."""
    runs = {}
    for name, coef, flags in (("config", COEF, []), ("flag_off", COEF, ["--aux_loss_coef", "0"]),
                              ("flag_on", 0.0, ["--aux_loss_coef", str(COEF)])):
        pretrain = save_tiny_moe(tmp_path / f"model_{name}", coef)
        argv = ["--pretrain", pretrain, "--dataset", sft_jsonl, "--save_path", str(tmp_path / name), *FLAGS, *flags]
        assert train_sft.main(argv) == 0
        runs[name] = read_metrics(tmp_path / name)[0]
    with_aux, without = runs["config"], runs["flag_off"]
    assert with_aux["loss"] == pytest.approx(without["loss"], abs=1e-6)
    assert abs(with_aux["grad_norm"] - without["grad_norm"]) > 1e-4
    assert 1.9 < with_aux["router_aux_loss"] < 2.5  # top-2 of 4 experts: 2 when balanced
    assert "router_aux_loss" not in without
    for key in ("loss", "grad_norm", "router_aux_loss"):
        assert runs["flag_on"][key] == pytest.approx(with_aux[key], abs=1e-6), key
