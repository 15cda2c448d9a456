"""OpenRLHF 0.11's flags (issue 41): every one of the 402 names its training commands define is in
``config/openrlhf.py``'s table, sets the openpack flag that means the same or is refused by name, and an OpenRLHF
0.11 command line gives the same ``config.yaml`` as its equivalent in openpack's names. Every default that differs
between the two is in the table's ``KEPT_DEFAULTS``, with why openpack keeps its own.

``tests/data/openrlhf_0_11/flags.tsv`` lists the names with their number of values and defaults, read from
0.11.0's source by ``extract_flags.py`` beside it; a flag missing from the table, or one the table has and 0.11
does not, fails here, and so does a default that comes to differ (or stops differing) on either side.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from openpack.config import commands, openrlhf, rl_checks
from openpack.config.runner import run_training
from openpack.config.schema import ConfigError

DATA = Path(__file__).parents[1] / "data" / "openrlhf_0_11"
COMMANDS = {"train_sft": "train_sft", "train_dpo": "train_dpo", "train_rm": "train_rm", "train_ppo_ray": "train_ppo"}
RUNS = {"train_sft": commands.SFT, "train_dpo": commands.DPO, "train_rm": commands.RM, "train_ppo": commands.PPO,
        "train_grpo": commands.GRPO}


def load_docs_tables():
    """``tests/data/openrlhf_0_11/docs_tables.py``: the docs page's tables and ``differing_defaults``."""
    sys.path.insert(0, str(DATA))
    try:
        import docs_tables
    finally:
        sys.path.remove(str(DATA))
    return docs_tables


def openrlhf_flags() -> dict[str, dict[str, tuple[str, object]]]:
    """openpack command -> OpenRLHF 0.11 flag -> (nargs, default), from the committed list."""
    flags: dict[str, dict[str, tuple[str, object]]] = {}
    for line in (DATA / "flags.tsv").read_text().splitlines():
        if not line.startswith("#"):
            command, flag, nargs, default = line.split("\t")
            flags.setdefault(COMMANDS[command], {})[flag] = (nargs, json.loads(default))
    return flags


def test_the_list_is_0_11s_whole_list():
    counts = {command: len(flags) for command, flags in openrlhf_flags().items()}
    assert counts == {"train_sft": 77, "train_dpo": 82, "train_rm": 79, "train_ppo": 164}


@pytest.mark.parametrize("command", ["train_sft", "train_dpo", "train_rm", "train_ppo", "train_grpo"])
def test_every_flag_of_0_11_is_in_the_table_and_no_other(command):
    want = openrlhf_flags()["train_ppo" if command == "train_grpo" else command]
    table = openrlhf.TABLES[command]
    assert sorted(set(want) - set(table)) == [], "OpenRLHF 0.11 flags missing from the table"
    assert sorted(set(table) - set(want)) == [], "flags in the table that OpenRLHF 0.11's command does not have"
    assert {name: twin.nargs for name, twin in table.items()} == {name: nargs for name, (nargs, _) in want.items()}


@pytest.mark.parametrize("command", sorted(RUNS))
def test_every_flag_sets_openpack_flags_that_exist(command):
    fields = {f"--{name}" for name in openrlhf.help_names(command)}
    parser_flags = set(config_flags(command))
    assert fields <= parser_flags
    for twin in openrlhf.TABLES[command].values():
        assert twin.kind in ("sets", "accepted", "refused") and twin.meaning
        assert (twin.kind == "sets") == bool(twin.sets), twin.name


def config_flags(command: str) -> list[str]:
    import dataclasses

    return [f"--{f.name}" for section in RUNS[command].run_config.section_classes() for f in dataclasses.fields(section)]


def a_value(twin: openrlhf.Twin) -> list[str]:
    """Values no refused flag takes as 'off' (nor equal to a policy setting it must match)."""
    return {"0": [], "1": ["7"], "2": ["7", "8"], "*": ["7"]}[twin.nargs]


@pytest.mark.parametrize("command", ["train_sft", "train_dpo", "train_rm", "train_ppo"])
def test_every_refused_flag_is_named_in_one_line(command):
    refused = [twin for twin in openrlhf.TABLES[command].values() if twin.kind == "refused"]
    assert len(refused) > 10
    for twin in refused:
        with pytest.raises(ConfigError) as err:
            openrlhf.translate(command, [twin.name, *a_value(twin)])
        assert str(err.value).startswith(twin.name) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("command", ["train_sft", "train_dpo", "train_rm", "train_ppo"])
def test_every_accepted_flag_sets_nothing_and_is_said(command):
    for twin in openrlhf.TABLES[command].values():
        if twin.kind == "accepted":
            translated = openrlhf.translate(command, [twin.name, *a_value(twin)])
            assert translated.argv == [] and len(translated.notes) == 1
            assert translated.notes[0].startswith(twin.name) and "\n" not in translated.notes[0]


@pytest.mark.parametrize("command", sorted(RUNS))
def test_classic_names_pass_through_unchanged(command):
    argv = ["--learning_rate", "1e-5", "--max_norm", "0.5", "--lr_scheduler", "cosine", "--save_steps", "3",
            "--unknown_flag", "x", "--adam_betas", "0.9", "0.99"]
    assert openrlhf.translate(command, argv).argv == argv


def saved_config(command: str, argv: list[str], tmp_path: Path, name: str) -> str:
    """The config.yaml a run of ``command`` with ``argv`` saves: its flags translated, parsed, written."""
    run = RUNS[command]
    translated = openrlhf.translate(command, argv).argv
    cfg = run.run_config.parse(translated, f"openpack {command}", "", aliases=run.aliases)
    cfg.save(tmp_path / name)
    return (tmp_path / name).read_text()


# Each pair: an OpenRLHF 0.11 command line (from its example scripts, with more flags), and the same run in
# openpack's names. Values differ from openpack's defaults so a flag that sets nothing would show.
SAME_RUNS = {
    "train_sft": (
        "--model.model_name_or_path org/llama --data.dataset a.jsonl,org/data --data.dataset_probs 0.3,0.7 "
        "--data.dataset_split validation --data.input_key question --data.output_key answer --data.max_len 1024 "
        "--data.max_samples 5000 --train.batch_size 64 --train.micro_batch_size 2 --train.max_epochs 3 "
        "--train.seed 7 --ckpt.output_dir ./out/sft --ckpt.save_steps -1 --ckpt.path ./out/ckpt --ckpt.max_num 2 "
        "--ckpt.load_enable --logger.logging_steps 5 --eval.steps -1 --ds.zero_stage 3 --ds.param_dtype bf16 "
        "--ds.attn_implementation sdpa --ds.packing_samples --ds.ring_attn_size 2 --ds.adam_offload "
        "--model.gradient_checkpointing_enable --adam.lr 2e-5 --adam.betas 0.9 0.99 --adam.eps 1e-6 "
        "--adam.weight_decay 0.01 --lr_scheduler cosine_with_min_lr --lr_warmup_ratio 0.05 --min_lr_ratio 0.2 "
        "--max_norm 0.5 --ds.lora.rank 8 --ds.lora.alpha 32 --ds.lora.target_modules q_proj v_proj "
        "--ds.lora.dropout 0.1 --model.aux_loss_coef 0.01 --data.input_template {} --ds.use_liger_kernel "
        "--logger.wandb.key offline --logger.wandb.project p --logger.wandb.run_name r "
        "--logger.tensorboard_dir ./tb --optim adam --ds.zpg 1 --ds.tensor_parallel_size 1 --ckpt.save_hf",
        "--pretrain org/llama --dataset a.jsonl org/data@validation --dataset_probs 0.3 0.7 --input_key question "
        "--output_key answer --max_len 1024 --max_samples 5000 --train_batch_size 64 --micro_train_batch_size 2 "
        "--max_epochs 3 --seed 7 --save_path ./out/sft --save_steps None --ckpt_path ./out/ckpt --max_ckpt_num 2 "
        "--load_checkpoint --logging_steps 5 --zero_stage 3 --bf16 --attn_backend sdpa --packing_samples "
        "--ring_attn_size 2 --adam_offload --gradient_checkpointing --learning_rate 2e-5 --adam_betas 0.9 0.99 "
        "--adam_epsilon 1e-6 --weight_decay 0.01 --lr_scheduler cosine --lr_warmup_ratio 0.05 --min_lr_ratio 0.2 "
        "--max_norm 0.5 --lora_rank 8 --lora_alpha 32 --target_modules q_proj v_proj --lora_dropout 0.1 "
        "--aux_loss_coef 0.01 --input_template {} --fused_loss --use_wandb offline --wandb_project p "
        "--wandb_run_name r --use_tensorboard ./tb"),
    "train_dpo": (
        "--model.model_name_or_path org/sft --ref.model_name_or_path org/ref --ref.offload --model.beta 0.2 "
        "--model.ipo_enable --model.label_smoothing 0.1 --model.nll_loss_coef 0.5 --data.dataset org/prefs "
        "--data.prompt_key p --data.chosen_key c --data.rejected_key r --data.apply_chat_template "
        "--data.max_len 8192 --train.batch_size 256 --train.micro_batch_size 1 --ds.zero_stage 3 "
        "--ds.param_dtype bf16 --adam.lr 5e-7 --ckpt.output_dir ./out/dpo --ckpt.save_steps 100 "
        "--ds.packing_samples --ds.attn_implementation flash_attention_2 --eval.steps -1 --ds.ring_attn_size 2",
        "--pretrain org/sft --ref_pretrain org/ref --ref_offload --beta 0.2 --loss_type ipo --label_smoothing 0.1 "
        "--nll_loss_coef 0.5 --dataset org/prefs --prompt_key p --chosen_key c --rejected_key r "
        "--apply_chat_template --max_len 8192 --train_batch_size 256 --micro_train_batch_size 1 --zero_stage 3 "
        "--bf16 --learning_rate 5e-7 --save_path ./out/dpo --save_steps 100 --packing_samples "
        "--attn_backend flash_attn --ring_attn_size 2"),
    "train_rm": (
        "--model.model_name_or_path org/sft --ds.value_head_prefix value_head --model.loss_type logexp "
        "--model.compute_fp32_loss_enable --data.dataset org/prefs --eval.dataset org/held,b.jsonl --eval.split test "
        "--eval.steps 50 --data.chosen_key chosen --data.rejected_key rejected --data.max_len 4096 "
        "--train.batch_size 128 --train.micro_batch_size 4 --adam.lr 9e-6 --ckpt.output_dir ./out/rm "
        "--ds.param_dtype bf16 --ds.packing_samples --ckpt.save_steps -1",
        "--pretrain org/sft --value_head_prefix value_head --loss logexp --dataset org/prefs "
        "--eval_dataset org/held@test b.jsonl --eval_steps 50 --chosen_key chosen --rejected_key rejected "
        "--max_len 4096 --train_batch_size 128 --micro_train_batch_size 4 --learning_rate 9e-6 "
        "--save_path ./out/rm --bf16 --packing_samples --save_steps None"),
    "train_ppo": (
        "--ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 2 --actor.num_gpus_per_node 8 "
        "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5 "
        "--actor.model_name_or_path org/sft --reward.model_name_or_path org/rm1,org/rm2 --critic.model_name_or_path "
        "org/critic --ckpt.output_dir ./out/ppo --ckpt.path ./out/ckpt --ckpt.save_hf --train.batch_size 128 "
        "--rollout.batch_size 256 --rollout.n_samples_per_prompt 4 --train.max_epochs 2 --data.max_len 3072 "
        "--rollout.max_new_tokens 1024 --data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16 "
        "--actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --algo.kl.estimator k2 "
        "--data.prompt_dataset org/prompts --data.prompt_probs 1.0 --data.input_key context_messages "
        "--data.label_key answer --data.apply_chat_template --reward.normalize_enable "
        "--actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend gloo --vllm.enforce_eager "
        "--vllm.enable_sleep --ds.enable_sleep --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 "
        "--rollout.max_tokens_per_gpu 16384 --algo.advantage.is_correction_enable "
        "--algo.advantage.is_correction_type icepop --algo.advantage.is_correction_threshold 0.2 4 "
        "--algo.advantage.estimator gae --algo.advantage.lambd 0.95 --algo.advantage.gamma 0.99 "
        "--actor.eps_clip 0.1 --actor.eps_clip_low_high 0.2 0.28 --actor.dual_clip 3 --critic.value_clip 0.3 "
        "--critic.freezing_steps 5 --actor.policy_loss_type gspo --actor.entropy_coef 0.001 "
        "--reward.clip_range -5 5 --reward.overlong_buffer_len 512.0 --reward.overlong_penalty_factor 0.5 "
        "--algo.kl.target 0.1 --algo.kl.horizon 5000 --rollout.temperature 0.9 --rollout.top_p 0.95 "
        "--train.num_episodes 2 --rollout.micro_batch_size 16 --train.async_enable --train.async_queue_size 2 "
        "--critic.adam.betas 0.9 0.95 --critic.max_norm 1.0 --train.seed 3 --actor.lr_warmup_ratio 0.0 "
        "--eval.dataset org/held --eval.split test --eval.steps 10 --eval.temperature 0.6 "
        "--eval.n_samples_per_prompt 4 --ckpt.best_metric_key eval/reward/pass@1",
        "--num_nodes 2 --num_gpus_per_node 8 --rollout_backend vllm --vllm_num_engines 4 "
        "--vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5 --pretrain org/sft "
        "--reward_pretrain org/rm1 org/rm2 --critic_pretrain org/critic --save_path ./out/ppo --ckpt_path ./out/ckpt "
        "--train_batch_size 128 --rollout_batch_size 256 --n_samples_per_prompt 4 --max_epochs 2 "
        "--prompt_max_len 2048 --generate_max_len 1024 --max_samples 100000 --zero_stage 3 --bf16 "
        "--learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --kl_estimator k2 "
        "--prompt_data org/prompts --prompt_data_probs 1.0 --input_key context_messages --label_key answer "
        "--apply_chat_template --gradient_checkpointing --packing_samples --vllm_sync_backend inhost "
        "--use_dynamic_batch --max_tokens_per_gpu 16384 --is_correction_type icepop "
        "--is_correction_threshold 0.2 4 --advantage_estimator gae --lambd 0.95 --gamma 0.99 --eps_clip 0.1 "
        "--eval_prompt_data org/held@test --eval_steps 10 --eval_temperature 0.6 --eval_n_samples_per_prompt 4 "
        "--best_metric_key eval/reward/pass@1 "
        "--eps_clip_low_high 0.2 0.28 --dual_clip 3 --value_clip 0.3 --freezing_actor_steps 5 "
        "--policy_loss_type gspo --entropy_coef 0.001 --reward_clip_range -5 5 --overlong_buffer_len 512 "
        "--overlong_penalty_factor 0.5 --target_kl 0.1 --kl_horizon 5000 --temperature 0.9 --top_p 0.95 "
        "--num_episodes 2 --micro_rollout_batch_size 16 --async_train --max_staleness 2 --seed 3 "
        "--lr_warmup_ratio 0.0"),
}


@pytest.mark.parametrize("command", sorted(SAME_RUNS))
def test_an_openrlhf_command_line_saves_the_config_of_its_classic_equivalent(command, tmp_path):
    dotted, classic = (text.split() for text in SAME_RUNS[command])
    assert all(flag in openrlhf.TABLES[command] for flag in dotted if flag.startswith("--"))
    assert not any(flag in openrlhf.TABLES[command] for flag in classic if flag.startswith("--")
                   and flag not in ("--lr_scheduler", "--lr_warmup_ratio", "--min_lr_ratio", "--max_norm"))
    saved = saved_config(command, dotted, tmp_path, "dotted.yaml")
    assert saved == saved_config(command, classic, tmp_path, "classic.yaml")
    assert saved != saved_config(command, [], tmp_path, "defaults.yaml")


def test_the_same_run_through_the_command_also_saves_the_same_config(monkeypatch, tmp_path, capsys):
    """The whole driver path (translation, demo defaults, checks) up to the launch, which is replaced by a
    function that saves the config the workers would get; the accepted flag is said once, before the launch."""
    saved = {}

    def launch(worker, cfg, *args, **kwargs):
        print("launched")
        cfg.save(tmp_path / f"{len(saved)}.yaml")
        saved[len(saved)] = (tmp_path / f"{len(saved)}.yaml").read_text()
        return 0

    monkeypatch.setattr(commands, "launch", launch)
    dotted = ["--ckpt.output_dir", str(tmp_path / "a"), "--adam.lr", "1e-3", "--train.seed", "5", "--ckpt.save_hf",
              "--ckpt.save_steps=-1", "--ds.packing_samples"]
    classic = ["--save_path", str(tmp_path / "b"), "--learning_rate", "1e-3", "--seed", "5", "--save_steps", "None",
               "--packing_samples"]
    assert run_training(commands.SFT, dotted) == 0
    out = capsys.readouterr().out
    assert out.count("--ckpt.save_hf: openpack saves a Hugging Face model folder") == 1
    assert out.index("--ckpt.save_hf") < out.index("launched")
    assert run_training(commands.SFT, classic) == 0
    assert saved[0].replace(str(tmp_path / "a"), "X") == saved[1].replace(str(tmp_path / "b"), "X")


@pytest.mark.parametrize("argv,expected", [
    (["--ds.deepcompile"], "--ds.deepcompile: DeepSpeed's DeepCompile is not in openpack"),
    (["--optim", "muon"], "--optim muon: the Muon optimizer"),
    (["--ds.param_dtype", "fp16"], "--ds.param_dtype fp16: fp16 training"),
    (["--ds.attn_implementation", "flash_attention_3"], "--ds.attn_implementation flash_attention_3: that kernel"),
    (["--ds.tensor_parallel_size", "2"], "--ds.tensor_parallel_size 2: DeepSpeed tensor parallelism"),
    (["--data.dataset", "org/data@sub"], "OpenRLHF's name@data_dir"),
    (["--lr_scheduler", "polynomial"], "--lr_scheduler polynomial: that schedule is not in openpack"),
    (["--ds.lora.rank"], "--ds.lora.rank takes 1 value, got 0"),
])
def test_a_refused_flag_exits_2_with_one_line_before_any_work(monkeypatch, capsys, argv, expected):
    def started(*args, **kwargs):
        raise AssertionError("the run started before the flags were checked")

    monkeypatch.setattr(commands, "launch", started)
    assert run_training(commands.SFT, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("openpack train_sft: ") and expected in err, err


@pytest.mark.parametrize("argv,classic", [
    (["--algo.advantage.is_correction_enable"], ["--is_correction_type", "tis"]),
    (["--algo.advantage.is_correction_type", "icepop", "--algo.advantage.is_correction_enable"],
     ["--is_correction_type", "icepop"]),
    (["--algo.dynamic_filtering_enable"], ["--dynamic_filtering", "--dynamic_filtering_reward_range", "0", "1"]),
    (["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9"],
     ["--dynamic_filtering", "--dynamic_filtering_reward_range", "0.1", "0.9"]),
    (["--vllm.num_engines", "0"], ["--rollout_backend", "hf"]),
    (["--vllm.sync_backend", "nccl"], ["--vllm_sync_backend", "nccl"]),
    (["--critic.freezing_steps", "-1"], ["--freezing_actor_steps", "0"]),
    (["--data.max_len", "1000", "--train.agent_func_path", "a.py"],
     ["--max_episode_tokens", "1000", "--agent_func_path", "a.py"]),
    (["--data.max_len", "2048"], ["--max_len", "2048", "--prompt_max_len", "2047", "--generate_max_len", "2048"]),
    (["--data.max_len", "2048", "--rollout.max_new_tokens", "512"], ["--prompt_max_len", "1536",
                                                                      "--generate_max_len", "512"]),
    (["--train.agent_func_path", "a.py", "--data.max_len", "74240", "--rollout.max_new_tokens", "64000"],
     ["--agent_func_path", "a.py", "--max_episode_tokens", "74240", "--prompt_max_len", "10240",
      "--generate_max_len", "64000"]),  # OpenRLHF's agent turns get what the episode has left
    (["--rollout.vllm_generate_batch_size", "1024"], []),  # the run's --rollout_batch_size (the default)
    (["--reward.remote_url", "/openrlhf/examples/python/reward_func.py"],
     ["--remote_rm_url", "/openrlhf/examples/python/reward_func.py"]),  # OpenRLHF's reward file (issue 41)
    (["--critic.adam.eps", "1e-08"], []),
    (["--critic.lr_scheduler", "cosine_with_min_lr", "--actor.lr_scheduler", "cosine"], ["--lr_scheduler", "cosine"]),
])
def test_rl_values_keep_openrlhfs_meaning(argv, classic):
    assert openrlhf.translate("train_grpo", argv).argv == classic


@pytest.mark.parametrize("argv,note", [
    (["--algo.advantage.is_correction_type", "icepop"], "no correction, as in OpenRLHF without"),
    (["--train.async_queue_size", "4"], "nothing to queue"),
    (["--rollout.max_tokens_per_gpu", "32768"], "pack under the training cap"),  # a speed knob: same numbers
])
def test_a_setting_openrlhf_ignores_alone_is_said_and_sets_nothing(argv, note):
    translated = openrlhf.translate("train_ppo", argv)
    assert translated.argv == [] and note in translated.notes[0]


@pytest.mark.parametrize("argv,expected", [
    (["--reward.remote_url", "http://a,http://b"], "several reward servers"),
    (["--critic.adam.betas", "0.9", "0.99"], "optimizer settings of the critic's own"),
    (["--reward.overlong_buffer_len", "10.5"], "a whole number"),
])
def test_rl_values_openpack_cannot_take_are_refused(argv, expected):
    with pytest.raises(ConfigError, match=None) as err:
        openrlhf.translate("train_ppo", argv)
    assert expected in str(err.value)


def test_sft_reads_a_conversation_from_the_input_key_with_the_chat_template():
    translated = openrlhf.translate("train_sft", ["--data.input_key", "messages", "--data.apply_chat_template"])
    assert translated.argv == ["--messages_key", "messages", "--apply_chat_template"]
    assert openrlhf.translate("train_sft", ["--data.input_key", "q"]).argv == ["--input_key", "q"]


def test_help_shows_both_names(capsys):
    with pytest.raises(SystemExit) as exit:
        run_training(commands.PPO, ["--help"])
    assert exit.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--pretrain PRETRAIN" in out and "(OpenRLHF 0.11: --actor.model_name_or_path)" in out
    assert "(OpenRLHF 0.11: --actor.adam.lr)" in out and "refused (openpack lacks the feature), or accepted at the value" in out
    assert "--ds.deepcompile" in out and "docs/openrlhf.md" in out


def test_the_docs_page_holds_the_whole_table():
    docs_tables = load_docs_tables()
    page = docs_tables.DOCS.read_text()
    assert f"{docs_tables.BEGIN}\n{docs_tables.tables()}\n{docs_tables.END}" in page, \
        "docs/openrlhf.md is behind the table: run python tests/data/openrlhf_0_11/docs_tables.py"
    for flags in openrlhf_flags().values():
        assert all(f"| `{flag}` |" in page for flag in flags)


@pytest.mark.parametrize("command", sorted(RUNS))
def test_every_default_that_differs_from_0_11_has_its_reason(command):
    """Both sides' defaults, from their sources: OpenRLHF 0.11.0's parsers (flags.tsv) and openpack's config
    dataclasses, each OpenRLHF default translated by the table (so -1 is none, bf16 is --bf16). The flags whose
    defaults differ are exactly those ``KEPT_DEFAULTS`` gives a one-line reason for: openpack took every other
    default from OpenRLHF (issue 41), and a default changed on either side fails here until it is adopted or
    explained."""
    differ, kept = load_docs_tables().differing_defaults(command), openrlhf.KEPT_DEFAULTS[command]
    assert sorted(set(differ) - set(kept)) == [], "defaults that differ from OpenRLHF 0.11's with no reason in " \
        "config/openrlhf.py's KEPT_DEFAULTS: take OpenRLHF's, or say why not"
    assert sorted(set(kept) - set(differ)) == [], "reasons for defaults that no longer differ: drop them"
    assert all(why and "\n" not in why for why in kept.values())


def test_a_default_changed_on_either_side_is_seen(monkeypatch):
    """The comparison above can fail: a value OpenRLHF changes, an openpack field default changed, a switch
    openpack turns on by default and a none OpenRLHF leaves unset against a value each show as differing."""
    from openpack.config import rl, sections, sft

    docs_tables = load_docs_tables()
    same = docs_tables.differing_defaults("train_sft")
    assert "--adam.lr" not in same and "--train.max_epochs" not in same
    theirs = {**docs_tables.openrlhf_defaults()["train_sft"], "--adam.lr": 1e-4}
    assert docs_tables.differing_defaults("train_sft", theirs)["--adam.lr"] == ("0.0001", "--learning_rate 5e-06")

    def set_default(section, name, value):
        monkeypatch.setattr(next(f for f in dataclasses.fields(section) if f.name == name), "default", value)

    set_default(sft.SFTTrainConfig, "max_epochs", 1)
    set_default(sections.ModelConfig, "gradient_checkpointing", True)
    assert {"--train.max_epochs", "--model.gradient_checkpointing_enable"} <= set(
        docs_tables.differing_defaults("train_sft"))
    assert "--data.label_key" not in docs_tables.differing_defaults("train_ppo")
    set_default(rl.PromptDataConfig, "label_key", "answer")
    assert docs_tables.differing_defaults("train_ppo")["--data.label_key"] == ("none", "--label_key answer")


# OpenRLHF 0.11's RL example scripts (``example_scripts.tsv``: each script's train_ppo_ray flags, as bash expands
# them, written by ``extract_example_scripts.py``): accepted with only paths, sizes and GPU counts to change (with
# the token budgets they get: --max_len, --prompt_max_len, --generate_max_len), or refused at start by the first
# flag that asks for a feature openpack lacks.
SHARED_2048 = (2048, 2047, 2048)  # --data.max_len 2048 alone: a budget each completion shares with its prompt
EXAMPLE_SCRIPTS = {
    "train_ppo_ray_hybrid_engine.sh": SHARED_2048,
    "train_ppo_with_reward_fn.sh": SHARED_2048,
    "train_dapo_ray_hybrid_engine.sh": SHARED_2048,
    "train_prorlv2_math_hybrid_engine.sh": (None, 1024, 8192),  # --data.max_len 9216 --rollout.max_new_tokens 8192
    "train_reinforce_baseline_hybrid_engine.sh": "--ds.ring_attn_size 2: context parallelism in RL",
    "train_reinforce_baseline_ray_agent_async.sh": "--ds.ring_attn_size 2: context parallelism in RL",
    "train_vlm_math_hybrid_engine.sh": "--data.max_images_per_prompt 1: vision-language models",
}


def example_scripts() -> dict[str, list[str]]:
    rows = (line.split("\t") for line in (DATA / "example_scripts.tsv").read_text().splitlines()
            if not line.startswith("#"))
    return {script: json.loads(argv) for script, argv in rows}


def test_the_example_scripts_are_0_11s_rl_scripts():
    assert set(example_scripts()) == set(EXAMPLE_SCRIPTS)


@pytest.mark.parametrize("script", sorted(EXAMPLE_SCRIPTS))
def test_an_openrlhf_example_script_is_accepted_or_refused_naming_the_feature(script):
    argv, expected = example_scripts()[script], EXAMPLE_SCRIPTS[script]
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as err:
            openrlhf.translate("train_ppo", argv)
        assert str(err.value).startswith(expected) and "is not in openpack" in str(err.value), err.value
        return
    translated = openrlhf.translate("train_ppo", argv)
    cfg = commands.PPO.run_config.parse(translated.argv, "openpack train_ppo", "", aliases=commands.PPO.aliases)
    assert (cfg.rollout.max_len, cfg.data.prompt_max_len, cfg.rollout.generate_max_len) == expected
    rl_checks.check_shared_budget(cfg)


@pytest.mark.parametrize("argv,expected", [
    (["--max_len", "512"], "--prompt_max_len 1024 leaves a prompt no room for a completion within --max_len 512: "
                           "give --prompt_max_len below it (prompts longer are left out), e.g. 511"),
    (["--max_len", "512", "--prompt_max_len", "100", "--env_file", "env.py"],
     "--max_len 512 is the budget of a prompt and its single completion; an episode's is --max_episode_tokens: "
     "give that instead"),
])
def test_a_shared_budget_that_cannot_hold_is_refused(argv, expected):
    """--max_len (OpenRLHF's --data.max_len alone) leaves every prompt kept room for one token of completion."""
    cfg = commands.PPO.run_config.parse(argv, "openpack train_ppo", "", aliases=commands.PPO.aliases)
    with pytest.raises(ConfigError) as err:
        rl_checks.check_shared_budget(cfg)
    assert str(err.value) == expected
