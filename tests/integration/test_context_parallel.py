"""A packed row split over 2 gloo processes equals the whole row: log-probs and summed gradients to 1e-5 (fp32).

Two processes (``context_parallel_script.py``) each run their part of the row through ``PackedCausalLM``, keys and
values all-gathered in every layer (``models.context_parallel``); log-probs and the two ranks' parameter gradients
are summed and compared with one unsplit forward and backward. Cases: Llama (4 query heads over 2 KV heads), Llama
with 8 over 2, Qwen2 with an 8-token window on one layer, Gemma-2 (attention and final logit softcaps, a window on
alternating layers), Llama with dynamic NTK rope (frequencies from each document's whole length), Llama with gradient
checkpointing (each layer's K/V all-gather runs again in the backward). The guard case
splits the row as one document (attention over every gathered key before a token): it must fail.

The pair losses on a row of three pairs: DPO's (policy and reference log-prob sums summed over the group before
the loss) and a reward model's (each reward read on the rank that holds the segment's last token, one pair's chosen
on rank 1 and rejected on rank 0), each rank's part of the gradient summed as DeepSpeed sums it. The guard for
pairs: losses from each rank's own part of the sums must fail.

Online RL's completions on a row of three (one longer than a rank's share, an episode with a hole in its
targets): the scoring pass gathered back into whole rows, and GSPO's sequence ratio, seq-mask-tis's geometric mean
and seq_mean_token_mean's lengths totalled over the group, through the trainer's own ``rl.experience`` and
``core.rl_losses``. The guard: each rank's sequence quantities from its own part of the sums.

Then the commands end to end: ``openpack train_sft``, ``train_dpo``, ``train_rm``, ``train_grpo`` and ``train_ppo
--ring_attn_size 2`` on 2 ranks equal one rank (slow: the SFT runs about 3 minutes each on a busy 2-core machine, DPO
and RM under 2, each RL pair 1-5), and what they cannot split is refused up front.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openpack.core.context_parallel import split_row
from openpack.distributed.process import free_port

from context_parallel_script import CASES, LENGTHS, PAIR_LENGTHS, PROMPT_LENGTHS
from saved_runs import BARE_PROMPTS, write_pairs

SCRIPT = Path(__file__).with_name("context_parallel_script.py")

EXACT = [name for name, case in CASES.items() if not case[3]]


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel") / "errors.json"
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), str(rank), "2", port, str(out)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


def test_the_row_has_the_hard_cases():
    """A document straddles the split, one is longer than a rank's share, one starts on the second rank."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    for window in (None, 8):
        shards = split_row(cu, 2, window)
        segments = [set(s.piece_segment.tolist()) for s in shards]
        assert segments[0] & segments[1]
        assert max(LENGTHS) > max(s.num_tokens for s in shards)
        starts_on_rank_1 = shards[1].piece_segment[shards[1].piece_offset == 0].tolist()
        assert starts_on_rank_1 and set(starts_on_rank_1) - segments[0]


@pytest.mark.parametrize("case", EXACT)
def test_split_row_equals_whole_row(errors, case):
    assert errors[case]["logprob_error"] < 1e-5, errors[case]
    assert errors[case]["grad_error"] < 1e-5, errors[case]


def test_ignoring_document_boundaries_fails(errors):
    """The guard: splitting the row as one document (a ring over the concatenated row) must not pass."""
    assert errors["llama_boundaries_ignored"]["logprob_error"] > 1e-2
    assert errors["llama_boundaries_ignored"]["grad_error"] > 1e-3


def test_the_pair_row_has_the_hard_cases(errors):
    """A document longer than either rank's share whose labels all lie on rank 0; a pair whose chosen reward is read
    on rank 1 and rejected on rank 0 (a short segment), another whose chosen ends in skipped tokens on rank 0."""
    lengths = [n for pair in PAIR_LENGTHS for n in pair]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    shards = split_row(cu, 2)
    assert max(lengths) > max(s.num_tokens for s in shards)
    first_label = PROMPT_LENGTHS[0][0]  # segment 0's labels sit at offsets >= its prompt's length
    on_rank_1 = shards[1].piece_segment == 0
    assert (shards[1].piece_offset[on_rank_1] + shards[1].piece_length[on_rank_1] <= first_label).all()
    readers = errors["rm_pairs"]["read_on_rank"]  # per segment: chosen, rejected of each pair
    assert readers == [0, 0, 1, 0, 1, 0], readers


@pytest.mark.parametrize("case", ["dpo_pairs", "rm_pairs"])
def test_pair_losses_of_a_split_row_equal_the_whole_row(errors, case):
    assert errors[case]["loss_error"] < 1e-5, errors[case]
    assert errors[case]["grad_error"] < 1e-5, errors[case]
    assert errors[case].get("value_error", 0) < 1e-5, errors[case]


def test_pair_losses_from_uncombined_parts_fail(errors):
    """The guard: each rank's pair losses from its own part of the log-prob sums, added, are not the row's."""
    assert errors["dpo_pairs_not_combined"]["loss_error"] > 1e-2, errors["dpo_pairs_not_combined"]


def test_rl_completions_of_a_split_row_equal_the_whole_row(errors):
    """Every rank holds part of the long completion's response and each holds some of the row's response tokens; the
    split row's scores, loss and summed gradients are the whole row's, with a completion masked whole by
    seq-mask-tis and some tokens clipped (both sides of GSPO's clip are taken)."""
    result = errors["rl_completions"]
    assert result["score_error"] < 1e-5, result
    assert result["loss_error"] < 1e-6 and abs(result["loss"]) > 1e-2, result
    assert result["grad_error"] < 1e-5 * max(1.0, result["grad_scale"]), result
    assert result["masked_tokens"][0] == result["masked_tokens"][1] > 0, result
    assert 0 < result["clipped_tokens"] < sum(result["response_tokens_per_rank"]), result
    assert min(result["response_tokens_per_rank"]) > 0, result


def test_rl_sequence_quantities_from_uncombined_parts_fail(errors):
    """The guard: GSPO's ratio and seq-mask-tis's mean from each rank's own part of a completion's sums (the whole
    length still dividing) give another loss than the whole row's (the split one matches to 1e-6)."""
    assert errors["rl_completions_not_combined"]["loss_error"] > 1e-4, errors["rl_completions_not_combined"]


def _sft(save_path, pretrain, dataset, *flags):
    from openpack.cli import train_sft
    assert train_sft.main(["--pretrain", pretrain, "--dataset", dataset, "--save_path", str(save_path),
                           *SFT_COMMON, *flags]) == 0
    return save_path


# test_train_sft.py's two steps of 8 samples, packed into rows of up to 128 tokens per rank
SFT_COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
              "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100", "--launcher",
              "local", "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128", *BARE_PROMPTS]


@pytest.fixture(scope="module")
def one_rank_sft(tmp_path_factory, tiny_pretrain, sft_jsonl):
    """One rank, rows of up to 128 tokens (ZeRO-2 and ZeRO-3 train alike: tests/integration/test_zero_stages.py)."""
    return _sft(tmp_path_factory.mktemp("one_rank"), tiny_pretrain, sft_jsonl)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", ["2", "3"])
def test_train_sft_ring_of_two_equals_one_rank(tmp_path, one_rank_sft, tiny_pretrain, sft_jsonl, zero_stage):
    """``train_sft --ring_attn_size 2`` on 2 ranks (one context group, rows of up to 2 x 128 tokens) gives the
    losses, grad norms and weights of one rank with rows of 128: each rank's loss is its tokens' share of the
    step's sum, so DeepSpeed's mean over the world times the world size is the whole gradient, with ZeRO
    partitioning over both ranks and no data-parallel group of its own."""
    from hang_guard import HANG_S
    from saved_runs import assert_same_run, read_metrics

    ring = tmp_path / "ring"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl,
           "--save_path", str(ring), *SFT_COMMON, "--ring_attn_size", "2", "--zero_stage", zero_stage]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(ring, one_rank_sft)
    rows = [m["micro_batches"] for m in read_metrics(ring)]
    assert rows < [m["micro_batches"] for m in read_metrics(one_rank_sft)]  # rows hold more than 128 tokens


@pytest.mark.parametrize("flags, says", [
    (["--no_packing_samples", "--no_use_dynamic_batch"], "--ring_attn_size 2 needs --packing_samples"),
    ([], "a world size it divides (the run has 1 rank(s))"),  # --launcher local: one rank
])
def test_train_sft_refuses_what_it_cannot_split(flags, says, capsys):
    """Refused from the flags alone (the built-in demo's, which pack), in one line, before anything loads."""
    from openpack.cli import train_sft
    assert train_sft.main(["--save_path", "unused", "--launcher", "local", "--ring_attn_size", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


TWO_RANKS = ["--launcher", "ray", "--num_gpus_per_node", "2"]  # the planned world (refused before Ray starts)


@pytest.mark.parametrize("command, flags, says", [
    ("train_dpo", ["--launcher", "local"], "--ring_attn_size 2 needs a world size it divides (the run has 1 rank(s))"),
    ("train_rm", [*TWO_RANKS, "--no_packing_samples", "--no_use_dynamic_batch"],
     "--ring_attn_size 2 needs --packing_samples"),
    ("train_dpo", [*TWO_RANKS, "--prefix_sharing"], "--prefix_sharing is not split over ranks: --ring_attn_size 2"),
    ("train_rm", [*TWO_RANKS, "--prefix_sharing"], "--prefix_sharing is not split over ranks: --ring_attn_size 2"),
    ("train_dpo", [*TWO_RANKS, "--fused_loss"], "--fused_loss with --ring_attn_size 2"),
    ("train_dpo", [*TWO_RANKS, "--ref_num_nodes", "1"], "--ref_num_nodes with --ring_attn_size 2"),
    ("train_rm", [*TWO_RANKS, "--max_len", "48", "--max_tokens_per_gpu", "40"],
     "more than --max_tokens_per_gpu 40 x --ring_attn_size 2 (a row's tokens)"),
    ("train_rm", [*TWO_RANKS, "--ring_attn_size", "0"], "--ring_attn_size must be >= 1, got 0"),
])
def test_pair_commands_refuse_what_they_cannot_split(command, flags, says, capsys):
    """Refused from the flags alone (the built-in demo's), in one line, exit 2, before Ray or a model load."""
    import importlib
    argv = ["--save_path", "unused", "--ring_attn_size", "2", *flags]
    assert importlib.import_module(f"openpack.cli.{command}").main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def uneven_pairs(tmp_path_factory):
    """test_train_rm.py's pairs (with margins), every third rejected cut to 2 letters: a chosen then often holds
    more than half its row, so more than either rank's share of it."""
    path = tmp_path_factory.mktemp("uneven_pairs") / "pairs.jsonl"
    rows = [json.loads(line) for line in open(write_pairs(path))]
    with open(path, "w") as f:
        f.writelines(json.dumps({**row, "rejected": row["rejected"][:2] if i % 3 == 0 else row["rejected"],
                                 "margin": (i % 5 - 2) / 4}) + "\n" for i, row in enumerate(rows))
    return str(path)


# test_train_dpo.py's and test_train_rm.py's two steps of 8 pairs; rows of up to 2 x 48 tokens per context group
PAIR_COMMON = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
               "--lr_scheduler", "constant", "--max_len", "48", "--seed", "1", "--max_norm", "100",
               "--adam_epsilon", "1e-6", "--packing_samples", "--use_dynamic_batch"]
PAIR_FLAGS = {"train_dpo": ["--loss_type", "sigmoid", "ipo", "--loss_weights", "1", "0.1", "--nll_loss_coef", "0.5",
                            "--beta", "0.5"],
              "train_rm": ["--margin_key", "margin", "--center_rewards_coefficient", "0.01"]}
# the ring's ZeRO stage; one rank runs --zero_stage 2 as stage 0 (ZeRO-3 on one rank trains alike, 2x slower here)
RING_ZERO = {"train_dpo": ["--zero_stage", "3"], "train_rm": ["--zero_stage", "2"]}


def _torchrun(argv, command):
    from hang_guard import HANG_S
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", command, *argv]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=HANG_S)


def _trained_rows(command, argv):
    """The packed rows of the run ``argv`` on 2 ranks, as its ranks collate them (before the split)."""
    import importlib

    from openpack.config import commands
    from openpack.core.batch import collate_packed
    from openpack.data.preference import pair_segments
    from openpack.models.loading import load_tokenizer
    from openpack.trainers.dpo_worker import tokenization, tokenize_pair_rows
    from openpack.trainers.run import own_items

    cfg = {"train_dpo": commands.DPO, "train_rm": commands.RM}[command].run_config.parse(argv, command, "")
    plans = getattr(importlib.import_module(f"openpack.trainers.{command[6:]}_worker"), f"plan_{command[6:]}")(cfg, 2)
    how = tokenization(cfg.data, cfg.rm.margin_key if command == "train_rm" else None)
    tokenizer = load_tokenizer(cfg.model.pretrain)
    pairs = own_items(plans[0], lambda rows: tokenize_pair_rows(rows, tokenizer, how))
    segments = pair_segments(False)
    return [collate_packed([seg for i in ids for seg in segments(pairs[i], i)])
            for step in plans[0].steps for ids in step.micro_batches]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train_dpo", "train_rm"])
def test_pair_commands_ring_of_two_equal_one_rank(command, tmp_path, tiny_pretrain, tiny_reference, uneven_pairs):
    """``--ring_attn_size 2`` on 2 ranks (rows of up to 2 x 48 tokens) gives one rank's losses, grad norms and
    weights (rows of up to 96): DPO (sigmoid + IPO + NLL, a reference model split like the policy, ZeRO-3) and RM
    (margins, centering, ZeRO-2). Rows hold more than a rank's cap, and a chosen response longer than either
    rank's share of its row. Then the checkpoint: DPO refuses a resume without the ring, RM resumes exactly at
    step 1."""
    from saved_runs import assert_same_run, read_metrics

    data = ["--pretrain", tiny_pretrain, "--dataset", uneven_pairs, *PAIR_COMMON, *PAIR_FLAGS[command]]
    if command == "train_dpo":
        data += ["--ref_pretrain", tiny_reference]
    one, ring = tmp_path / "one", tmp_path / "ring"
    import importlib
    main = importlib.import_module(f"openpack.cli.{command}").main
    assert main([*data, "--save_path", str(one), "--max_tokens_per_gpu", "96", "--launcher", "local"]) == 0
    ring_argv = [*data, *RING_ZERO[command], "--save_path", str(ring), "--max_tokens_per_gpu", "48",
                 "--ring_attn_size", "2", "--save_steps", "1"]
    result = _torchrun(ring_argv, command)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(ring, one)
    assert [m["pairs"] for m in read_metrics(ring)] == [8, 8]  # counted once per context group

    rows = _trained_rows(command, ring_argv)
    assert max(row.num_tokens for row in rows) > 48
    assert any(int((row.cu_seqlens[1:] - row.cu_seqlens[:-1]).max()) > max(s.num_tokens for s in
               split_row(row.cu_seqlens, 2)) for row in rows)

    if command == "train_dpo":
        _refuses_a_resume_without_the_ring([*data, *RING_ZERO[command], "--save_path", str(ring),
                                            "--max_tokens_per_gpu", "96"], command)
    else:  # from step 1's checkpoint, step 2 again: the same weights
        _resume_from_step_1(ring, ring_argv, command)
        assert_same_run(ring, one)


def _refuses_a_resume_without_the_ring(argv, command):
    """A resume of a ring's run with --ring_attn_size unset (1) on the same 2 ranks: refused, naming both sizes."""
    refused = _torchrun([*argv, "--load_checkpoint", "--max_steps", "3"], command)
    assert refused.returncode != 0
    assert "written with --ring_attn_size 2 and this run has --ring_attn_size 1" in refused.stderr, \
        refused.stderr[-3000:]


def _resume_from_step_1(ring, ring_argv, command):
    """The ring's run of 2 steps resumed from step 1's checkpoint: step 2 trained again, logged once."""
    from saved_runs import read_metrics

    (ring / "checkpoints" / "latest").write_text("global_step1")
    shutil.rmtree(ring / "checkpoints" / "global_step2")
    resumed = _torchrun([*ring_argv, "--load_checkpoint"], command)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [m["step"] for m in read_metrics(ring)] == [1, 2]


# test_train_ppo.py's and test_ppo_critic.py's two rollout batches of 4 prompts x 4 completions in steps of 8 over 2
# epochs (4 updates a batch: the old-policy pass, the clip and the optimizer state all matter), HF generation seeded
# per prompt (every layout samples the same completions), completions of up to 16 tokens (a whole one straddles the
# split: test_rl_rows_straddle_the_split), rows of up to 96 tokens: 2 x 48 for the ring
RL_COMMON = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "2",
             "--generate_max_len", "16", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
             "--max_norm", "100", "--max_steps", "2", "--rollout_backend", "hf", "--packing_samples",
             "--use_dynamic_batch", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0"]
RL_FLAGS = {
    # GSPO's sequence ratio (its paper's clip range), seq_mean_token_mean's lengths, a k3 KL loss (the reference
    # pass), an entropy bonus
    "train_grpo": ["--policy_loss_type", "gspo", "--loss_agg_mode", "seq_mean_token_mean", "--use_kl_loss",
                   "--init_kl_coef", "0.05", "--kl_estimator", "k3", "--entropy_coef", "0.01",
                   "--adam_epsilon", "1e-6"],
    # a critic (GAE, clipped values) from the policy's weights with a new value head, the reward's KL penalty with an
    # adaptive coefficient. Not from the reward model: its head is scaled x20 (conftest), which turned the split
    # row's other summation order into values 1.2e-5 apart by the second rollout batch. Adam's eps as
    # test_ppo_critic.py's SHARING_EPS: at 1e-6 Adam turned that rounding in the critic's tiniest gradients into
    # 1.3e-5 on one critic weight (the policy's weights: 3e-7)
    "train_ppo": ["--advantage_estimator", "gae", "--gamma", "0.9", "--lambd", "0.8", "--value_clip", "0.2",
                  "--critic_learning_rate", "5e-3", "--init_kl_coef", "0.05", "--target_kl", "0.001",
                  "--kl_horizon", "32", "--adam_epsilon", "1e-4"],
}


def _rl_data(command, request):
    """The model, prompts and reward of ``command``'s run: GRPO a rule reward, PPO a reward model (conftest) and a
    critic from the policy."""
    if command == "train_grpo":
        root = request.getfixturevalue("rl_model")
        reward = ["--reward_fn", f"{root / 'reward.py'}:reward"]
    else:
        root = request.getfixturevalue("ppo_models")
        reward = ["--reward_pretrain", str(root / "rm"), "--critic_pretrain", str(root / "model")]
    return ["--pretrain", str(root / "model"), "--prompt_data", str(root / "prompts.jsonl"), *reward, *RL_COMMON,
            *RL_FLAGS[command]]


def test_rl_rows_straddle_the_split():
    """A whole completion (--generate_max_len 16) after any prompt of up to --prompt_max_len 32 tokens has trained
    tokens on both ranks of a ring of 2, in either rotation of a row's leftovers: the ring runs below train whole
    completions (their metrics say response_length/max 16), so their sums really are split over the ranks."""
    from openpack.core.batch import Segment, collate_packed
    from openpack.core.context_parallel import held_labels

    for prompt in range(1, 33):
        row = collate_packed([Segment(list(range(prompt + 16)), [False] * prompt + [True] * 16, k) for k in range(2)])
        for shard in split_row(row.cu_seqlens, 2):
            held = held_labels(row.loss_mask, shard)  # labels 0..15: completion 0's, 16..31: completion 1's
            assert (held < 16).any() and (held >= 16).any(), (prompt, shard.rank)
            assert 0 < (held < 16).sum() < 16 and 0 < (held >= 16).sum() < 16, (prompt, shard.rank)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train_grpo", "train_ppo"])
def test_rl_commands_ring_of_two_equal_one_rank(command, tmp_path, request):
    """``--ring_attn_size 2`` on 2 ranks (rows of up to 2 x 48 tokens) gives one rank's losses, grad norms and
    weights (rows of up to 96): GRPO with GSPO, seq_mean_token_mean and a KL loss (policy, old-policy and reference
    passes split), PPO with a critic (its values scored split and gathered for GAE, its update split; its metrics
    and weights compared too) and the reward's adaptive KL penalty. Generation (each rank its share of the prompts)
    and rewards see whole sequences. Then the checkpoint: GRPO refuses a resume without the ring, PPO resumes
    exactly at step 1, critic included."""
    import importlib

    from saved_runs import assert_same_critic, assert_same_run, read_metrics

    data = _rl_data(command, request)
    one, ring = tmp_path / "one", tmp_path / "ring"
    main = importlib.import_module(f"openpack.cli.{command}").main
    assert main([*data, "--save_path", str(one), "--max_tokens_per_gpu", "96", "--no_prefix_sharing",
                 "--launcher", "local"]) == 0
    ring_argv = [*data, "--save_path", str(ring), "--max_tokens_per_gpu", "48", "--ring_attn_size", "2",
                 "--save_steps", "1"]
    result = _torchrun(ring_argv, command)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(ring, one)
    if command == "train_ppo":
        assert_same_critic(ring, one)
    assert all(m["response_length/max"] == 16 for m in read_metrics(ring))  # whole completions: split over ranks

    if command == "train_grpo":
        _refuses_a_resume_without_the_ring([*data, "--save_path", str(ring), "--max_tokens_per_gpu", "96",
                                            "--no_prefix_sharing"], command)
    else:  # from step 1's checkpoint, step 2 again: the same weights, the critic's too
        _resume_from_step_1(ring, ring_argv, command)
        assert_same_run(ring, one)
        assert_same_critic(ring, one)


@pytest.mark.parametrize("command, flags, says", [
    ("train_grpo", ["--launcher", "local"], "--ring_attn_size 2 needs a world size it divides (the run has 1 rank(s))"),
    ("train_ppo", [*TWO_RANKS, "--no_packing_samples", "--no_use_dynamic_batch"],
     "--ring_attn_size 2 needs --packing_samples"),
    ("train_grpo", [*TWO_RANKS, "--prefix_sharing"], "--prefix_sharing is not split over ranks: --ring_attn_size 2"),
    ("train_ppo", [*TWO_RANKS, "--ref_num_nodes", "1"], "--ref_num_nodes with --ring_attn_size 2"),
    ("train_grpo", [*TWO_RANKS, "--teacher_num_nodes", "1", "--teacher_pretrain", "unused_teacher"],
     "--teacher_num_nodes with --ring_attn_size 2"),
    ("train_grpo", [*TWO_RANKS, "--max_tokens_per_gpu", "40", "--prompt_max_len", "64", "--generate_max_len", "32"],
     "can be 96 tokens (--prompt_max_len + --generate_max_len), more than --max_tokens_per_gpu 40 x --ring_attn_size "
     "2 (a row's tokens)"),
])
def test_rl_commands_refuse_what_they_cannot_split(command, flags, says, capsys):
    """Refused from the flags alone (the built-in demo's, which pack), in one line, exit 2, before Ray or a model
    load."""
    import importlib
    argv = ["--save_path", "unused", "--ring_attn_size", "2", *flags]
    assert importlib.import_module(f"openpack.cli.{command}").main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_rl_refuses_an_moe_router_loss_under_a_ring(tmp_path, rl_model, capsys):
    """An MoE policy's router loss is a function of each row's whole token set: refused from its config before any
    worker starts, with the fix; --aux_loss_coef 0 turns it off and passes the check."""
    from openpack.cli import train_grpo
    from openpack.config.commands import GRPO
    from openpack.config.rl_checks import check_rl_context_parallel

    from saved_runs import save_tiny_llama

    moe = save_tiny_llama(tmp_path / "moe", seed=0, arch="mixtral")
    argv = ["--pretrain", moe, "--prompt_data", str(rl_model / "prompts.jsonl"), "--save_path", str(tmp_path / "run"),
            "--ring_attn_size", "2", "--packing_samples", "--use_dynamic_batch", *TWO_RANKS]
    capsys.readouterr()
    assert train_grpo.main(argv) == 2
    err = capsys.readouterr().err
    assert "the MoE policy's router load-balancing loss is not split over a context group; pass --aux_loss_coef 0" \
        in err and len(err.strip().splitlines()) == 1, err
    check_rl_context_parallel(GRPO.run_config.parse([*argv, "--aux_loss_coef", "0"], "train_grpo", ""))
