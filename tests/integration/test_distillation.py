"""On-policy distillation end to end (`train_grpo --teacher_pretrain DIR`, issue 42 item 5): without a reward the
teacher's per-token reverse KL is the whole signal, and a few steps lower the student's KL to the teacher; a teacher
whose tokenizer differs, and flags distillation cannot use, are refused in one line before any model loads.

The student is rl_model's random tiny Llama; the teacher another one (seed 4) with its output layer scaled by 30,
so it is confident where the student is nearly uniform: the starting reverse KL is large (about 13 nats a token).
"""

import pytest

from openpack.cli import train_grpo
from openpack.data.demo_tokenizer import build_demo_tokenizer

from saved_runs import read_metrics, save_tiny_llama

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
             max_position_embeddings=256)  # rl_model's
RUN = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16", "--generate_max_len",
       "8", "--prompt_max_len", "32", "--learning_rate", "1e-2", "--seed", "1", "--rollout_backend", "hf",
       "--launcher", "local", "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "256",
       "--logging_steps", "1", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0"]  # as measured (RL's
# default schedule is OpenRLHF's cosine with warm-up since issue 41)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A confident teacher sharing the student's (demo) tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path_factory.mktemp("teacher"), seed=4, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    return path


def argv(rl_model, save_path, *flags):
    return ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--save_path", str(save_path), *RUN, *flags]


def test_distillation_alone_lowers_the_students_reverse_kl(rl_model, teacher, tmp_path):
    """Five rollout batches, no reward: every reward is 0, each step's advantages are exactly minus the logged
    reverse KL on average (coef 1, nothing else in them), and the KL falls to under 60% of where it started
    (measured 13.4 -> 6.0 nats a token)."""
    assert train_grpo.main(argv(rl_model, tmp_path, "--teacher_pretrain", teacher, "--max_steps", "5")) == 0
    metrics = read_metrics(tmp_path)
    kls = [m["distill/reverse_kl"] for m in metrics]
    print("distill/reverse_kl by step:", [round(x, 3) for x in kls])
    assert len(kls) == 5 and all(m["reward"] == 0 for m in metrics)
    for m in metrics:
        assert abs(m["advantages/mean"] + m["distill/reverse_kl"]) < 1e-4 * max(1.0, m["distill/reverse_kl"]), m
    assert kls[0] > 5 and kls[-1] < 0.6 * kls[0], kls


@pytest.mark.parametrize("flags, message", [
    (["--distill_coef", "0.5"], "--distill_coef shapes on-policy distillation, and this run has no teacher"),
    (["--teacher_offload", "--teacher_pretrain", "T"], "--teacher_offload needs --zero_stage 3"),
    (["--teacher_num_nodes", "1", "--teacher_pretrain", "T"], "--teacher_num_nodes puts the teacher in a Ray actor"),
    (["--teacher_pretrain", "T", "--advantage_estimator", "gae"], "a critic of zero returns only adds noise"),
    (["--teacher_pretrain", "T", "--dynamic_filtering"], "--dynamic_filtering drops groups of equal rewards"),
    (["--teacher_pretrain", "T", "--eval_prompt_data", "P"], "--eval_prompt_data scores held-out samples with the "
                                                            "run's reward"),
    (["--teacher_num_nodes", "1", "--launcher", "ray"], "--teacher_num_nodes places the distillation teacher, and "
                                                        "there is none"),
])
def test_flags_distillation_cannot_use_are_refused(flags, message, rl_model, teacher, tmp_path, capsys):
    flags = [{"T": teacher, "P": str(rl_model / "prompts.jsonl")}.get(f, f) for f in flags]
    assert train_grpo.main(argv(rl_model, tmp_path, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(rl_model, tmp_path, capsys):
    """The agent demo's tokenizer adds JSON characters after the demo's 46 tokens: same ids for those, but 49
    tokens, so refused, naming both models and the way out."""
    other = tmp_path / "other"
    save_tiny_llama(other, seed=4, **SHAPE)
    build_demo_tokenizer("{}\"").save_pretrained(other)
    capsys.readouterr()  # the save's own progress bars
    assert train_grpo.main(argv(rl_model, tmp_path / "run", "--teacher_pretrain", str(other))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"--teacher_pretrain {other} does not share the tokenizer of --pretrain {rl_model / 'model'}" in err[0]
    assert "vocabularies of 46 and 49 tokens" in err[0] and "use a teacher trained with the policy's tokenizer" \
        in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_teacher_inside_the_save_path_is_refused_and_kept(tmp_path, capsys):
    """`openpack train_grpo --teacher_pretrain runs/grpo_demo/model` without --save_path would run in the GRPO demo's
    own folder, whose --overwrite deletes the teacher: refused, the teacher left as it was."""
    save_tiny_llama(tmp_path / "model", seed=4, **SHAPE)
    capsys.readouterr()
    assert train_grpo.main(["--teacher_pretrain", str(tmp_path / "model"), "--save_path", str(tmp_path),
                            "--launcher", "local", "--rollout_backend", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lies inside --save_path" in err[0] and "another --save_path" in err[0], err
    assert (tmp_path / "model" / "config.json").exists()
