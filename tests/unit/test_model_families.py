"""The model support matrix (issue 28): every family packs exactly, or is refused before anything loads.

Each family is a tiny random model with its special features on (``models.tiny.FAMILIES``): sliding windows of
8 tokens, length-dependent rope types whose original context (32) is shorter than some packed segments,
softcaps small enough that tanh saturates, experts, NoPE layers, partial rotary. A packed row must give each
segment the log-probs and gradients it gets alone through transformers' eager attention (fp32, 1e-5, through
openpack's public forward), and so must a padded batch for the rope types whose frequencies depend on length.
"""

import contextlib
import json

import pytest
import torch

from openpack.cli import check_packing
from openpack.core.batch import collate_padded
from openpack.models import packed
from openpack.models.families import VERIFIED, UnsupportedModelError, check_model_family
from openpack.models.tiny import FAMILIES, tiny_causal_lm, tiny_config
from openpack.models.verify import (packed_vs_unpacked, random_segments, reference_token_logprobs,
                                    shared_vs_unpacked, within_error_budget)

LENGTHS = [7, 13, 1, 40, 5, 2, 64, 31]  # past the 8-token windows and the 32-token original contexts
EXACT = [name for name in FAMILIES if name != "falcon"]
LENGTH_DEPENDENT_ROPE = ["llama_dynamic_rope", "phi3_longrope"]
GROUPS = [(9, [4, 7, 1, 12]), (3, [5, 5]), (20, [2])]  # (prompt, completions): an RL group, a DPO pair, one


@pytest.mark.parametrize("family", EXACT)
def test_packed_equals_one_at_a_time(family):
    model = tiny_causal_lm(family, seed=1)
    check_model_family(model.config)  # not refused
    result = packed_vs_unpacked(model, LENGTHS, seed=1)
    assert within_error_budget(result) and result["packed_logprob_error"] <= 1e-5, result


def test_the_budget_is_relative_to_the_log_probs_magnitude():
    """SmolLM2-135M's measured fp32 noise passes (log-probs to -25); a fault of 3e-4 does not."""
    smollm2 = {"packed_logprob_error": 3.4e-5, "logprob_scale": 25.0, "packed_grad_error": 5e-3, "grad_scale": 1696.0,
               "unpacked_logprob_error": 0.0, "unpacked_grad_error": 0.0}
    assert within_error_budget(smollm2)
    assert not within_error_budget({**smollm2, "packed_logprob_error": 3e-4})
    assert not within_error_budget({**smollm2, "logprob_scale": 1.0})


def test_every_verified_family_is_in_the_matrix():
    assert {FAMILIES[name][0] for name in EXACT} == set(VERIFIED)


@pytest.mark.parametrize("family", LENGTH_DEPENDENT_ROPE)
def test_whole_row_rope_frequencies_are_caught(family, monkeypatch):
    """Without per-sequence frequencies a short segment gets the long segment's: the check above can fail."""
    monkeypatch.setattr(packed, "per_sequence_rope", lambda model, batch: contextlib.nullcontext())
    result = packed_vs_unpacked(tiny_causal_lm(family, seed=1), LENGTHS, seed=1)
    assert result["packed_logprob_error"] > 1e-3, result


@pytest.mark.parametrize("family", LENGTH_DEPENDENT_ROPE)
def test_padded_rows_get_their_own_rope_frequencies(family):
    model = tiny_causal_lm(family, seed=1)
    segments = random_segments(LENGTHS, model.config.vocab_size, seed=2)
    batch = collate_padded(segments)
    padded = packed.padded_token_logprobs(model, batch).reshape(batch.labels.shape)
    reference = reference_token_logprobs(model, segments)
    rows = [padded[i, :len(s.tokens)] for i, s in enumerate(segments)]
    torch.testing.assert_close(torch.cat(rows), reference, atol=1e-5, rtol=0)


def test_dynamic_rope_reference_is_history_free():
    """transformers' dynamic rope keeps the longest forward's frequencies; the reference resets them per segment,
    so a segment's log-probs do not depend on what ran before it."""
    model = tiny_causal_lm("llama_dynamic_rope", seed=1)
    short, long = random_segments([20, 64], model.config.vocab_size, seed=3)
    alone = reference_token_logprobs(model, [short])
    after_long = reference_token_logprobs(model, [long, short])[64:]
    torch.testing.assert_close(after_long, alone, atol=0, rtol=0)


def test_falcon_is_refused_from_its_config():
    with pytest.raises(UnsupportedModelError) as err:
        check_model_family(tiny_config("falcon"), "--pretrain")
    message = str(err.value)
    assert "--pretrain" in message and "AttentionInterface" in message and "llama" in message


@pytest.mark.parametrize("family", LENGTH_DEPENDENT_ROPE)
def test_prefix_sharing_is_refused_with_length_dependent_rope(family):
    check_model_family(tiny_config(family), prefix_sharing=False)
    with pytest.raises(UnsupportedModelError, match="--prefix_sharing"):
        check_model_family(tiny_config(family), prefix_sharing=True)


@pytest.mark.parametrize("field", ["logit_scale", "logits_scaling"])
def test_logit_transforms_are_refused_from_the_config(field):
    with pytest.raises(UnsupportedModelError, match=f"config.{field}"):
        check_model_family(tiny_config("llama", **{field: 0.5}))


def test_check_packing_checks_a_saved_model(tmp_path, capsys):
    tiny_causal_lm("phi3_longrope", seed=1).save_pretrained(tmp_path / "phi3")
    assert check_packing.main(["--pretrain", str(tmp_path / "phi3"), "--lengths", *map(str, LENGTHS)]) == 0
    out = capsys.readouterr().out
    (line,) = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert line["passed"] and line["arch"] == str(tmp_path / "phi3")
    assert f"exact across {tmp_path / 'phi3'}" in out


def test_check_packing_refuses_a_saved_falcon_before_loading_it(tmp_path, capsys):
    tiny_config("falcon").save_pretrained(tmp_path / "falcon")  # config only: a load would fail on the weights
    assert check_packing.main(["--pretrain", str(tmp_path / "falcon")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "AttentionInterface" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["train_sft", "train_dpo"])
def test_training_commands_refuse_falcon_before_data_or_weights(command, tmp_path, capsys):
    """Only the config exists and the dataset is missing: the model's family is what the one line names."""
    from openpack.cli import train_dpo, train_sft

    tiny_config("falcon").save_pretrained(tmp_path / "falcon")
    main = {"train_sft": train_sft.main, "train_dpo": train_dpo.main}[command]
    argv = ["--pretrain", str(tmp_path / "falcon"), "--dataset", str(tmp_path / "missing.jsonl"),
            "--save_path", str(tmp_path / "run"), "--launcher", "local"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--pretrain" in err and "AttentionInterface" in err, err


def test_dpo_refuses_prefix_sharing_with_longrope_before_loading(tmp_path, capsys):
    from openpack.cli import train_dpo

    tiny_config("phi3_longrope").save_pretrained(tmp_path / "phi3")
    argv = ["--pretrain", str(tmp_path / "phi3"), "--dataset", str(tmp_path / "missing.jsonl"), "--prefix_sharing",
            "--packing_samples", "--save_path", str(tmp_path / "run"), "--launcher", "local"]
    assert train_dpo.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "longrope" in err and "--prefix_sharing" in err, err


@pytest.mark.parametrize("flags, family, shared", [
    (["--packing_samples", "--use_dynamic_batch"], None, True),  # the demo model
    (["--packing_samples", "--use_dynamic_batch"], "llama", True),
    (["--packing_samples", "--use_dynamic_batch"], "phi3_longrope", False),  # no exact shared encoding: off
    (["--packing_samples", "--use_dynamic_batch", "--no_prefix_sharing"], "llama", False),
    (["--packing_samples"], "llama", False),
    ([], "llama", False),
])
def test_rl_prefix_sharing_is_the_default_where_it_is_exact(flags, family, shared, tmp_path):
    from openpack.config.rl import GRPORunConfig
    from openpack.config.rl_checks import with_prefix_sharing

    model = []
    if family is not None:
        tiny_config(family).save_pretrained(tmp_path / family)
        model = ["--pretrain", str(tmp_path / family)]
    cfg = GRPORunConfig.parse([*model, "--prompt_data", "p.jsonl", *flags], "openpack train_grpo", "")
    assert cfg.train.prefix_sharing is (False if "--no_prefix_sharing" in flags else None)
    assert with_prefix_sharing(cfg).train.prefix_sharing is shared


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "gpt_neox"])
def test_a_prefix_shared_row_equals_each_completion_alone(family):
    """check_packing's second layout: each prompt once, its completions after it, against prompt + completion
    alone (summed log-probs per completion and gradients)."""
    result = shared_vs_unpacked(tiny_causal_lm(family, seed=1), GROUPS, seed=1)
    assert result["tokens"] < result["unshared_tokens"]
    assert within_error_budget(result), result


def test_the_prefix_shared_check_can_fail(monkeypatch):
    """Completions that see the prompt's keys top-left aligned (their first token sees the prompt's first only)."""
    from openpack.models import attention

    monkeypatch.setattr(attention, "_bottom_right_mask", lambda q, k, window, device: torch.ones(
        q, k, dtype=torch.bool, device=device).tril())
    grouped = attention._shared_cross_mask  # SDPA's grouped pass: the prompt's keys top-left aligned too

    def top_left(segment, offset, prompt, window):
        mask = grouped(segment, offset, prompt, window)
        mask[:, :prompt] = torch.arange(prompt)[None, :] <= offset[:, None]
        return mask

    monkeypatch.setattr(attention, "_shared_cross_mask", top_left)
    result = shared_vs_unpacked(tiny_causal_lm("llama", seed=1), GROUPS, seed=1)
    assert result["packed_logprob_error"] > 1e-2, result
