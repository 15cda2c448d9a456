"""LoRA (``--lora_rank``) end to end on CPU: only the adapters train, in SFT, DPO, RM and RL; what leaves the
trainer is the merged model; the DPO/RL reference is the base model with the adapters disabled.

Tiny models, 2-4 optimizer steps of 8 samples each, learning rate 1e-2 (LoRA's B starts at zero, so a step
at 1e-3 barely moves the merged weights).
"""

import json
import math
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from openpack.cli import train_dpo, train_rm, train_sft

from hang_guard import HANG_S
from saved_runs import BARE_PROMPTS, load_weights, read_metrics

LORA = ["--lora_rank", "8", "--lora_alpha", "16"]
NO_LORA = ["--train_batch_size", "8", "--learning_rate", "1e-2", "--lr_warmup_ratio", "0", "--lr_scheduler",
           "constant", "--max_len", "48", "--seed", "1", "--max_norm", "100", "--adam_epsilon", "1e-6",
           "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "160", "--launcher", "local",
           *BARE_PROMPTS]
COMMON = [*NO_LORA, *LORA]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all-linear on Llama


def lora_cfg(rank=8, **kw):
    return SimpleNamespace(lora_rank=rank, lora_alpha=16, lora_dropout=0.0, target_modules=["all-linear"],
                           load_in_4bit=False, gradient_checkpointing=False, **kw)


def sft(save_path, pretrain, dataset, *flags):
    argv = ["--pretrain", pretrain, "--dataset", dataset, "--save_path", str(save_path), *COMMON, *flags]
    assert train_sft.main(argv) == 0
    return save_path


def assert_only_adapters_moved(run, base_folder):
    """The merged export differs from the base only in the adapted linear layers (and the reward head)."""
    merged, base = load_weights(run), load_file(f"{base_folder}/model.safetensors")
    assert set(merged) - set(base) <= {"score.weight"}  # a reward model: its head instead of the LM head
    moved = {name for name in set(base) & set(merged) if not torch.equal(merged[name], base[name])}
    assert moved and all(any(t in name for t in TARGETS) for name in moved), sorted(moved)
    adapter = load_file(f"{run}/adapter/adapter_model.safetensors")
    assert all("lora_" in name or "score" in name for name in adapter), sorted(adapter)
    assert all(w.abs().sum() > 0 for name, w in adapter.items() if "lora_B" in name)  # B starts at zero


def models_memory_checked(monkeypatch) -> list:
    """The models the memory check before the first step sizes (``batching.training_memory``, spied on)."""
    from openpack.trainers import batching

    seen, real = [], batching.training_memory
    monkeypatch.setattr(batching, "training_memory", lambda model, *a, **k: seen.append(model) or real(model, *a, **k))
    return seen


def assert_memory_checked_with_adapters(seen):
    """The check counted only the adapters (and a reward head) as trained: it ran after apply_lora."""
    from openpack.models.lora import is_lora

    assert seen and all(is_lora(model) for model in seen), [type(model).__name__ for model in seen]


def stopped_at_step_2(run, tmp_path):
    """A save path holding only ``run``'s step-2 checkpoint, as if the run had stopped there."""
    interrupted = tmp_path / "interrupted"
    (interrupted / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "global_step2", interrupted / "checkpoints" / "global_step2")
    (interrupted / "checkpoints" / "latest").write_text("global_step2")
    return interrupted


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_pretrain, sft_jsonl):
    return sft(tmp_path_factory.mktemp("sft_lora"), tiny_pretrain, sft_jsonl, "--max_steps", "4", "--save_steps",
               "2", "--max_ckpt_num", "5")


def test_sft_trains_only_the_adapters(sft_run, tiny_pretrain):
    losses = [m["loss"] for m in read_metrics(sft_run)]
    assert losses[-1] < losses[0], losses
    assert_only_adapters_moved(sft_run, tiny_pretrain)
    config = json.loads((sft_run / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16  # all-linear: every projection, not the LM head
    assert {name.split(".")[-1] for name in config["target_modules"]} == set(TARGETS), config["target_modules"]


def test_the_merged_export_equals_the_base_with_its_adapters(sft_run, tiny_pretrain):
    """Plain transformers loads <save_path>/model; its logits are the base + adapter's (peft) to 1e-5 in fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(sft_run / "model").eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_pretrain),
                                             sft_run / "adapter").eval()
    ids = torch.randint(3, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = with_adapter(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        with with_adapter.disable_adapter():
            assert (with_adapter(input_ids=ids).logits - expected).abs().max() > 1e-3  # the adapters matter


def test_resumed_equals_uninterrupted(sft_run, tmp_path, tiny_pretrain, sft_jsonl):
    """Stopped after step 2 (its checkpoint holds the adapters and their optimizer state), resumed: steps 3-4 and
    the merged export match the uninterrupted run."""
    interrupted = stopped_at_step_2(sft_run, tmp_path)
    sft(interrupted, tiny_pretrain, sft_jsonl, "--max_steps", "4", "--save_steps", "2", "--max_ckpt_num", "5",
        "--load_checkpoint")
    resumed, uninterrupted = read_metrics(interrupted), read_metrics(sft_run)
    assert [m["step"] for m in resumed] == [3, 4]
    for x, y in zip(resumed, uninterrupted[2:]):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5, (x, y)
    full = load_weights(sft_run)
    for name, w in load_weights(interrupted).items():
        torch.testing.assert_close(w, full[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("change, flag", [(["--lora_rank", "4"], "--lora_rank 8 -> 4"),
                                          (["--lora_alpha", "32"], "--lora_alpha 16 -> 32"),
                                          (["--target_modules", "q_proj", "v_proj"],
                                           "--target_modules all-linear -> q_proj v_proj"),
                                          (["--lora_rank", "0"], "--lora_rank 8 -> 0")])
def test_a_resume_with_other_lora_settings_is_refused_before_deepspeed_loads(change, flag, sft_run, tmp_path,
                                                                             tiny_pretrain, sft_jsonl, capsys):
    """Today DeepSpeed's load_state_dict failed on the adapters' keys and shapes (or, for --lora_alpha, the
    adapters resumed rescaled); now openpack refuses first, naming the flag, both values and the fix."""
    interrupted = stopped_at_step_2(sft_run, tmp_path)
    argv = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(interrupted), *COMMON,
            "--max_steps", "4", "--save_steps", "2", "--load_checkpoint", *change]
    capsys.readouterr()
    assert train_sft.main(argv) == 2
    err = capsys.readouterr().err
    assert f"changes the LoRA adapters ({flag})" in err, err
    old = flag.split(" -> ")[0]
    assert f"Resume with {old}," in err and "--overwrite" in err, err
    assert "Traceback" not in err and not (interrupted / "metrics.jsonl").exists()


def test_dpo_reference_is_the_base_with_adapters_disabled(tmp_path, tiny_pretrain, dpo_jsonl, monkeypatch):
    """No second model: at step 1 the adapters are zero, so policy == reference (margin 0, loss ln 2); the cached
    reference (--ref_logps_cache) is scored with the adapters off; after training only the adapters moved."""
    memory_checked = models_memory_checked(monkeypatch)
    cache = tmp_path / "ref.pt"
    run = tmp_path / "dpo"
    argv = ["--pretrain", tiny_pretrain, "--dataset", dpo_jsonl, "--save_path", str(run), *COMMON, "--max_steps",
            "2", "--loss_type", "sigmoid", "--beta", "0.5", "--ref_logps_cache", str(cache)]
    assert train_dpo.main(argv) == 0
    first, second = read_metrics(run)
    assert abs(first["rewards/margins"]) < 1e-5 and abs(first["loss"] - math.log(2)) < 1e-5, first
    assert abs(second["rewards/margins"]) > 1e-4, second
    assert cache.exists()
    assert_only_adapters_moved(run, tiny_pretrain)
    assert_memory_checked_with_adapters(memory_checked)


def test_adapter_reference_scores_as_a_separately_loaded_base(tiny_pretrain):
    """AdapterReference (the LoRA policy, adapters disabled) == ModelReference of the base loaded on its own;
    with the adapters on, the policy scores differently (the guard)."""
    from openpack.core.batch import CHOSEN, REJECTED, Segment, collate_packed
    from openpack.models.loading import load_causal_lm
    from openpack.models.lora import apply_lora
    from openpack.models.packed import PackedCausalLM
    from openpack.trainers.reference import AdapterReference, ModelReference

    policy = apply_lora(load_causal_lm(tiny_pretrain), lora_cfg())
    torch.manual_seed(0)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    rng = torch.Generator().manual_seed(1)
    segments = [Segment(torch.randint(3, 40, (n,), generator=rng).tolist(), [False] * 3 + [True] * (n - 3), i // 2,
                        CHOSEN if i % 2 == 0 else REJECTED) for i, n in enumerate([9, 12, 7, 15])]
    batch = collate_packed(segments)
    ours = AdapterReference(PackedCausalLM(policy), policy, "cpu").segment_sums(batch)
    base = ModelReference(PackedCausalLM(load_causal_lm(tiny_pretrain)), "cpu").segment_sums(batch)
    torch.testing.assert_close(ours, base, atol=1e-5, rtol=0)
    assert policy.training  # switched back after scoring
    with torch.no_grad():
        adapted = ModelReference(PackedCausalLM(policy), "cpu").segment_sums(batch)
    assert (adapted - base).abs().max() > 1e-3


def test_the_optimizer_gets_only_adapters_and_the_reward_head(tiny_pretrain):
    from openpack.distributed.engine import _param_groups
    from openpack.models.loading import load_causal_lm
    from openpack.models.lora import apply_lora
    from openpack.models.packed import PackedCausalLM
    from openpack.models.reward import PackedRewardModel, load_reward_model

    for module in (PackedCausalLM(apply_lora(load_causal_lm(tiny_pretrain), lora_cfg())),
                   PackedRewardModel(apply_lora(load_reward_model(tiny_pretrain), lora_cfg(), head="score"))):
        trained = {id(p) for group in _param_groups(module, 0.1) for p in group["params"]}
        names = [name for name, p in module.named_parameters() if id(p) in trained]
        assert names and all("lora_" in n or "score.modules_to_save" in n for n in names), names
        assert len(names) < len(list(module.parameters()))


def test_rm_trains_adapters_and_its_head(tmp_path, tiny_pretrain, dpo_jsonl, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    memory_checked = models_memory_checked(monkeypatch)
    run = tmp_path / "rm"
    argv = ["--pretrain", tiny_pretrain, "--dataset", dpo_jsonl, "--save_path", str(run), *COMMON, "--max_steps", "3"]
    assert train_rm.main(argv) == 0
    losses = [m["loss"] for m in read_metrics(run)]
    assert losses[-1] < losses[0], losses
    assert_only_adapters_moved(run, tiny_pretrain)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert "score" in config["modules_to_save"]
    exported = AutoModelForSequenceClassification.from_pretrained(run / "model")  # plain transformers, one label
    assert exported.config.num_labels == 1 and "score.weight" in load_weights(run)
    assert_memory_checked_with_adapters(memory_checked)


def test_load_in_4bit_is_refused_where_it_cannot_run(tmp_path, tiny_pretrain, sft_jsonl, capsys):
    """No bitsandbytes or no CUDA GPU: one line naming the flag and the fix, before any model loads."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may run QLoRA")
    argv = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(tmp_path), *COMMON,
            "--load_in_4bit"]
    assert train_sft.main(argv) == 2
    err = capsys.readouterr().err
    assert "--load_in_4bit" in err and ("pip install bitsandbytes" in err or "CUDA GPU" in err), err
    assert "drop --load_in_4bit" in err and not (tmp_path / "run.json").exists()
    argv = ["--pretrain", tiny_pretrain, "--dataset", sft_jsonl, "--save_path", str(tmp_path), *NO_LORA,
            "--load_in_4bit"]
    assert train_sft.main(argv) == 2  # QLoRA without adapters
    assert "give --lora_rank" in capsys.readouterr().err


@pytest.mark.vllm
def test_ppo_with_lora_syncs_merged_weights_to_vllm(tmp_path, rl_model):
    """PPO (LoRA policy and critic, KL against the base with adapters off) with vLLM rollouts under ZeRO-3: the
    merged weights pushed after step 1 make vLLM's log-probs equal the trainer's to 1e-4 (step 2), as before any
    sync (step 1). In a subprocess, as test_train_ppo's vllm_run (vLLM tears down the default process group)."""
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"), "--reward_fn",
            f"{rl_model / 'reward.py'}:reward", "--save_path", str(tmp_path), "--advantage_estimator", "gae",
            "--critic_learning_rate", "1e-2", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
            "--train_batch_size", "8", "--max_epochs", "1", "--generate_max_len", "8", "--prompt_max_len", "32",
            "--learning_rate", "1e-2", "--seed", "1", "--max_norm", "100", "--max_steps", "2", "--init_kl_coef",
            "0.05", "--rollout_backend", "vllm", "--zero_stage", "3", "--packing_samples", "--use_dynamic_batch",
            "--max_tokens_per_gpu", "96", "--launcher", "local", *LORA]
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_ppo", *argv], capture_output=True,
                            text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["vllm_logp_diff"] < 1e-4, m
        assert m["time/weight_sync"] > 0
    assert metrics[0]["kl"] == pytest.approx(0, abs=1e-6)  # adapters start at zero: the policy is the base
    assert metrics[1]["kl"] > 0  # the reference stayed the base while the merged policy moved
    assert_only_adapters_moved(tmp_path, rl_model / "model")
    assert (tmp_path / "critic" / "config.json").exists()


def test_a_tied_lora_policy_sends_its_head_under_both_names():
    """Weight sync of a tied LoRA policy: the merged weights carry ``lm_head.weight`` too (vLLM refreshes a tied head
    only when that name is loaded, issue 23), in the order of ``merged_weight_names``; saving keeps one copy."""
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.lora import apply_lora, merged_weight_names, merged_weights
    from openpack.models.tiny import tiny_causal_lm

    tied = tiny_causal_lm("llama", seed=0, vocab_size=len(build_demo_tokenizer()), tie_word_embeddings=True)
    model = apply_lora(tied, lora_cfg())
    sent = list(merged_weights(model, tied_aliases=True))
    assert [name for name, _ in sent] == merged_weight_names(model)
    tensors = dict(sent)
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert "lm_head.weight" not in dict(merged_weights(model))  # the export's state dict: once, as before


def test_mixtral_experts_with_lora_save_merged(tmp_path, sft_jsonl):
    """Issue 41: LoRA on a Mixtral trained, then crashed at the save ('MixtralExperts' object has no attribute
    'weight'): transformers 5 stores the experts as stacked 3-D parameters, which peft's all-linear adapts through
    parameter wrappers. The experts' adapters now train and merge: the saved model is the base + adapter (peft)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from openpack.data.demo_tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    config = AutoConfig.for_model("mixtral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    base = tmp_path / "mixtral"
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    run = sft(tmp_path / "run", str(base), sft_jsonl, "--max_steps", "2")
    merged = load_weights(run)
    start = load_file(f"{base}/model.safetensors")
    experts = "model.layers.0.block_sparse_moe.experts.0.w1.weight"  # transformers saves Mixtral's classic names
    assert merged[experts].shape == start[experts].shape and not torch.equal(merged[experts], start[experts])
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "adapter").eval()
    saved = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    ids = torch.randint(3, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=ids).logits, with_adapter(input_ids=ids).logits, atol=1e-5, rtol=0)
