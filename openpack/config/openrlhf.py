"""OpenRLHF 0.11's flags on openpack's commands: one table, each flag either set to the openpack flag that means the
same or refused by name.

OpenRLHF renamed its flags in 0.10.2 (``--pretrain`` became ``--model.model_name_or_path``, ``--save_path``
``--ckpt.output_dir``, ...) and 0.11 accepts no flat name, while openpack's flags keep the flat names of 0.10.
``translate`` rewrites an OpenRLHF 0.11 command line into openpack's flags before anything parses it, so a run has
one config whichever names it was given, and saves the same ``config.yaml``; flags in openpack's names pass
through untouched, and the two kinds mix. Each OpenRLHF flag is one ``Twin``, in one of three kinds:

* **sets**: the openpack flags it sets and how its values become theirs, in OpenRLHF's meaning: -1 ("never")
  becomes none, ``a,b`` lists become ``a b``, ``--ds.param_dtype bf16`` becomes ``--bf16``, an enable switch
  (``--algo.advantage.is_correction_enable``) turns on the type it is given;
* **accepted**: what the flag asks for is already what openpack does (``--vllm.enforce_eager``), or it asks for
  nothing in this run (``--eval.steps`` with no ``--eval.dataset``); said once at start;
* **refused**: a feature openpack lacks (``--ds.deepcompile``, ``--optim muon``): one line naming the flag and
  the feature, exit 2, before Ray, DeepSpeed or a model load. The value that leaves the feature off
  (``--ds.tensor_parallel_size 1``) is accepted.

``train_ppo_ray``'s flags belong to ``train_ppo`` and ``train_grpo``. The trade-off: a translation cannot see the
values a run gets from openpack's defaults or ``--config``, so where one OpenRLHF flag depends on another
(``--critic.adam.betas`` must equal the policy's) the other is read from the command line, else openpack's default.
``docs/openrlhf.md`` shows the whole table, with both projects' defaults; ``tests/data/openrlhf_0_11/flags.tsv``
holds the 402 names read from 0.11.0's source, and a test holds the table against them.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from typing import Callable

from openpack.config.schema import ConfigError

PPO_COMMANDS = ("train_ppo", "train_grpo")  # both take train_ppo_ray's flags
SCHEDULERS = {"cosine_with_min_lr": "cosine", "constant_with_warmup": "constant"}  # transformers' names -> ours


class Given:
    """The flags of one command line with their values as typed, OpenRLHF's and openpack's (the last of a flag
    given twice, as argparse keeps)."""

    def __init__(self, items: list[tuple[str | None, list[str]]]):
        self.values = {flag: values for flag, values in items if flag is not None}

    def get(self, *flags: str) -> list[str] | None:
        """The values of the first of ``flags`` given, else None."""
        return next((self.values[f] for f in flags if f in self.values), None)

    def has(self, flag: str) -> bool:
        return flag in self.values


Translate = Callable[[list[str], Given], tuple[list[str], str | None]]  # values -> openpack argv, a note or None


@dataclass(frozen=True)
class Twin:
    """One OpenRLHF 0.11 flag: how many values it takes, the openpack flags it sets and how."""

    name: str  # --ds.packing_samples
    nargs: str  # "0" (a switch), "1", "2" or "*", as OpenRLHF declares it
    kind: str  # sets | accepted | refused
    sets: tuple[str, ...]  # the openpack flags it may set
    meaning: str  # the table's openpack column: what it does here, and any value whose meaning differs
    translate: Translate
    always: bool = False  # an accepted switch whose behaviour openpack always has: on, where OpenRLHF's is off


def _values(flag: str, values: list[str], nargs: str) -> list[str]:
    """``values`` checked against ``nargs``; OpenRLHF's argparse would refuse the same."""
    if (nargs == "0" and values) or (nargs.isdigit() and nargs != "0" and len(values) != int(nargs)):
        want = "no value" if nargs == "0" else f"{nargs} value{'s' * (nargs != '1')}"
        raise ConfigError(f"{flag} takes {want}, got {len(values)}: {' '.join(values) or '(none)'}")
    return values


def same(name: str, flag: str, nargs: str = "1", meaning: str = "",
         convert: Callable[[list[str]], list[str]] | None = None) -> Twin:
    """``name`` sets ``flag``: a switch to the switch, values to its values (through ``convert``)."""
    def translate(values: list[str], given: Given):
        return [flag] + (convert(values) if convert else values), None
    return Twin(name, nargs, "sets", (flag,), meaning or f"`{flag}`", translate)


def accepted(name: str, nargs: str, why: str, always: bool = False) -> Twin:
    """``name`` asks for what openpack does anyway (``why``): nothing to set, said at start. ``always``: a switch
    whose behaviour openpack has in every run (so its default is on, where OpenRLHF's is off)."""
    def translate(values: list[str], given: Given):
        return [], f"{name}{''.join(' ' + v for v in values)}: {why}"
    return Twin(name, nargs, "accepted", (), f"accepted: {why}", translate, always)


def missing(name: str, nargs: str, feature: str, off: tuple[str, ...] = (), fix: str = "") -> Twin:
    """``name`` asks for ``feature``, which openpack lacks: refused, unless its value is one of ``off`` (which
    leaves the feature off, so the flag is accepted and said at start)."""
    def translate(values: list[str], given: Given):
        if values and " ".join(values) in off:
            return [], f"{name} {' '.join(values)}: {feature} stays off, as openpack has it"
        raise ConfigError(f"{' '.join([name, *values])}: {feature} is not in openpack{'; ' + fix if fix else ''} "
                          "(an OpenRLHF 0.11 flag; docs/openrlhf.md)")
    offs = ", ".join(f"`{v}`" if v else "''" for v in off)
    shown = f"; accepted: {offs} (off)" if off else ""
    return Twin(name, nargs, "refused", (), f"refused: {feature}{shown}" + (f"; {fix}" if fix else ""), translate)


def custom(name: str, nargs: str, sets: tuple[str, ...], meaning: str, translate: Translate) -> Twin:
    return Twin(name, nargs, "sets", sets, meaning, translate)


# ---------------------------------------------------------------------------------------------- value rules


def never_is_none(values: list[str]) -> list[str]:
    """OpenRLHF's -1 ("never") is openpack's none."""
    return ["None"] if values == ["-1"] else values


def ring_attn_size() -> Twin:
    """OpenRLHF's 1 (its default: no context parallelism) is openpack's none, which means the same."""
    return same("--ds.ring_attn_size", "--ring_attn_size", convert=lambda v: ["None"] if v == ["1"] else v,
                meaning="`--ring_attn_size` (1, no context parallelism, is none)")


def comma_list(values: list[str]) -> list[str]:
    """OpenRLHF's ``a,b`` is openpack's ``a b``."""
    return [part.strip() for part in values[0].split(",") if part.strip()]


def datasets(name: str, flag: str, split_flag: str) -> Twin:
    """A comma list of datasets, each ``name`` or a local file; ``split_flag`` (other than train) is the split of the
    hub ones. OpenRLHF's ``name@data_dir`` is refused: in openpack ``@`` names a split."""
    def translate(values: list[str], given: Given):
        from openpack.data.loading import _looks_local

        specs = comma_list(values)
        if any("@" in spec for spec in specs):
            raise ConfigError(f"{name} {values[0]}: OpenRLHF's name@data_dir (a folder of a hub dataset) is not in "
                              f"openpack, where name@split names a split; give the folder's files instead")
        split = (given.get(split_flag) or ["train"])[0]
        if split != "train":
            specs = [spec if os.path.exists(os.path.expanduser(spec)) or _looks_local(spec) else f"{spec}@{split}"
                     for spec in specs]
        return [flag, *specs], None
    return custom(name, "1", (flag,), f"`{flag}`: `a,b` is `a b`; hub names get `@SPLIT` from `{split_flag}`; "
                  "OpenRLHF's `name@data_dir` refused", translate)


def split(name: str, datasets_flag: str, flag: str) -> Twin:
    """The split of ``datasets_flag``'s hub datasets (applied there, to ``flag``'s values); train is openpack's."""
    def translate(values: list[str], given: Given):
        if values != ["train"] and not given.has(datasets_flag):
            raise ConfigError(f"{name} {values[0]} is the split of {datasets_flag}'s hub datasets: give "
                              f"{datasets_flag} too, or name the split as name@split")
        return [], None
    return custom(name, "1", (flag,), f"the split of `{datasets_flag}`'s hub datasets, as `name@split` in "
                  f"`{flag}` (local files have one)", translate)


def param_dtype(values: list[str], given: Given):
    if values == ["bf16"]:
        return ["--bf16"], None
    raise ConfigError(f"--ds.param_dtype {values[0]}: fp16 training (with loss scaling) is not in openpack; use bf16 "
                      "(an OpenRLHF 0.11 flag; docs/openrlhf.md)")


ATTENTION = {"flash_attention_2": "flash_attn", "sdpa": "sdpa", "eager": "sdpa"}


def attn_implementation(values: list[str], given: Given):
    if values[0] not in ATTENTION:
        raise ConfigError(f"--ds.attn_implementation {values[0]}: that kernel is not in openpack, whose packed "
                          f"attention runs on {', '.join(sorted(set(ATTENTION.values())))} (from "
                          f"{', '.join(ATTENTION)}); an OpenRLHF 0.11 flag, docs/openrlhf.md")
    return ["--attn_backend", ATTENTION[values[0]]], None


def lr_scheduler(name: str, flag: str) -> Twin:
    """transformers' scheduler names; openpack's own three keep their meaning (each decays to --min_lr_ratio after
    a warm-up, where transformers' cosine and linear reach 0 and its constant has no warm-up)."""
    ours = ("cosine", "linear", "constant")

    def translate(values: list[str], given: Given):
        value = SCHEDULERS.get(values[0], values[0])
        if value not in ours:
            raise ConfigError(f"{name} {values[0]}: that schedule is not in openpack, which has "
                              f"{', '.join(SCHEDULERS)} (as {', '.join(SCHEDULERS.values())}) and its own "
                              f"{', '.join(ours)}; an OpenRLHF 0.11 flag, docs/openrlhf.md")
        return [flag, value], None
    return custom(name, "1", (flag,), f"`{flag}`: cosine_with_min_lr is `cosine`, constant_with_warmup `constant`; "
                  "`cosine`, `linear` and `constant` are openpack's (they decay to `--min_lr_ratio` after the "
                  "warm-up; transformers' reach 0, its constant has no warm-up)", translate)


# ---------------------------------------------------------------------------------------------- the tables

MUON = "the Muon optimizer (openpack trains with AdamW)"


def optimizer(prefix: str, lr_flag: str) -> list[Twin]:
    """``--optim`` / ``--actor.optim`` and their ``muon.*`` and ``adam.*`` flags, the schedule and clipping."""
    dot = f"--{prefix}." if prefix else "--"
    return [
        missing(f"{dot}optim", "1", MUON, off=("adam",)),
        missing(f"{dot}muon.lr", "1", MUON),
        missing(f"{dot}muon.momentum", "1", MUON),
        missing(f"{dot}muon.ns_steps", "1", MUON),
        missing(f"{dot}muon.nesterov", "0", MUON),
        missing(f"{dot}muon.no_nesterov", "0", MUON),
        same(f"{dot}adam.lr", lr_flag),
        same(f"{dot}adam.betas", "--adam_betas", "2"),
        same(f"{dot}adam.eps", "--adam_epsilon"),
        same(f"{dot}adam.weight_decay", "--weight_decay"),
        lr_scheduler(f"{dot}lr_scheduler", "--lr_scheduler"),
        same(f"{dot}lr_warmup_ratio", "--lr_warmup_ratio"),
        same(f"{dot}min_lr_ratio", "--min_lr_ratio"),
        same(f"{dot}max_norm", "--max_norm", meaning="`--max_norm` (0: no clipping)"),
    ]


def shared() -> list[Twin]:
    """The flags of all four commands whose meaning is the same in each."""
    return [
        same("--ckpt.output_dir", "--save_path", meaning="`--save_path`: the run's folder; the final model goes to "
             "its `model/` subfolder (OpenRLHF saves it in the folder itself)"),
        same("--ckpt.save_steps", "--save_steps", convert=never_is_none,
             meaning="`--save_steps`: -1 (never, but at the end) is none"),
        accepted("--ckpt.save_hf", "0", "openpack saves a Hugging Face model folder with every checkpoint",
                 always=True),
        missing("--ckpt.disable_ds", "0", "saving without DeepSpeed checkpoints (openpack keeps them to resume from)"),
        same("--logger.logging_steps", "--logging_steps"),
        same("--ckpt.path", "--ckpt_path"),
        same("--ckpt.max_num", "--max_ckpt_num"),
        missing("--ckpt.max_mem", "1", "a cap on checkpoints' size in GB", off=("100000000", "1e8", "inf"),
                fix="keep fewer with --ckpt.max_num"),
        same("--ckpt.load_enable", "--load_checkpoint", "0"),
        missing("--ds.use_universal_ckpt", "0", "DeepSpeed's universal checkpoints (a resume on another world size)"),
        same("--train.micro_batch_size", "--micro_train_batch_size"),
        same("--train.batch_size", "--train_batch_size"),
        missing("--ds.deepcompile", "0", "DeepSpeed's DeepCompile"),
        same("--train.seed", "--seed"),
        missing("--train.full_determinism_enable", "0", "transformers' full determinism (deterministic kernels)"),
        accepted("--local_rank", "1", "openpack reads each rank from the environment (LOCAL_RANK)"),
        same("--ds.zero_stage", "--zero_stage"),
        custom("--ds.param_dtype", "1", ("--bf16",), "`bf16` is `--bf16`; `fp16` refused (fp16 training); not "
               "given, openpack trains in fp32", param_dtype),
        missing("--ds.zpg", "1", "ZeRO++ hierarchical partitioning", off=("1",)),
        same("--ds.adam_offload", "--adam_offload", "0"),
        custom("--ds.attn_implementation", "1", ("--attn_backend",), "`--attn_backend`: flash_attention_2 is "
               "`flash_attn`, sdpa and eager are `sdpa` (exact attention per sequence); other kernels refused",
               attn_implementation),
        missing("--ds.experts_implementation", "1", "choosing the MoE experts' kernel (transformers picks it)"),
        missing("--ds.grad_accum_dtype", "1", "a gradient accumulation dtype of its own"),
        missing("--ds.overlap_comm", "0", "overlapping ZeRO's communication with the backward"),
        missing("--data.disable_fast_tokenizer", "0", "slow (Python) tokenizers"),
        accepted("--data.dataloader_num_workers", "1", "openpack's ranks read their own packs; there are no "
                 "DataLoader workers to start (the value is not used)"),
        missing("--ds.tensor_parallel_size", "1", "DeepSpeed tensor parallelism (AutoTP)", off=("1",)),
        same("--train.max_epochs", "--max_epochs"),
        accepted("--ds.ring_attn_head_stride", "1", "openpack's ring attention has no head stride to set (a speed "
                 "and memory knob of OpenRLHF's; the value is not used)"),
        same("--ds.load_in_4bit", "--load_in_4bit", "0"),
        same("--ds.lora.rank", "--lora_rank"),
        same("--ds.lora.alpha", "--lora_alpha"),
        same("--ds.lora.target_modules", "--target_modules", "*"),
        same("--ds.lora.dropout", "--lora_dropout"),
        same("--ds.packing_samples", "--packing_samples", "0"),
        same("--data.max_samples", "--max_samples", meaning="`--max_samples` (of all datasets together; OpenRLHF's "
             "is per dataset)"),
        same("--data.input_template", "--input_template", meaning="`--input_template` (one without `{}` is refused; "
             "OpenRLHF drops it with a warning)"),
        same("--data.apply_chat_template", "--apply_chat_template", "0"),
        same("--logger.wandb.key", "--use_wandb"),
        missing("--logger.wandb.org", "1", "a W&B entity of its own"),
        missing("--logger.wandb.group", "1", "W&B run groups"),
        same("--logger.wandb.project", "--wandb_project"),
        same("--logger.wandb.run_name", "--wandb_run_name"),
        same("--logger.tensorboard_dir", "--use_tensorboard"),
        missing("--use_ms", "0", "ModelScope downloads"),
    ]


def offline() -> list[Twin]:
    """train_sft's, train_dpo's and train_rm's shared flags."""
    return [
        *shared(), *optimizer("", "--learning_rate"),
        same("--model.gradient_checkpointing_enable", "--gradient_checkpointing", "0"),
        missing("--model.gradient_checkpointing_reentrant", "0", "reentrant activation checkpointing (openpack's "
                "is non-reentrant)"),
        same("--model.aux_loss_coef", "--aux_loss_coef", meaning="`--aux_loss_coef` (0: no MoE balancing loss)"),
        same("--model.model_name_or_path", "--pretrain"),
        datasets("--data.dataset", "--dataset", "--data.dataset_split"),
        same("--data.dataset_probs", "--dataset_probs", convert=comma_list, meaning="`--dataset_probs`: `a,b` is "
             "`a b`"),
        split("--data.dataset_split", "--data.dataset", "--dataset"),
        missing("--data.tokenizer_chat_template", "1", "a chat template given on the command line"),
        same("--data.max_len", "--max_len"),
    ]


def held_out(command: str) -> list[Twin]:
    """``--eval.*`` of train_sft and train_dpo: openpack evaluates neither on held-out rows."""
    feature = f"held-out evaluation in {command}"
    nothing = f"nothing to evaluate ({feature} is not in openpack; the value is not used)"
    return [missing("--eval.dataset", "1", feature), accepted("--eval.steps", "1", nothing),
            accepted("--eval.split", "1", nothing)]


def sft() -> list[Twin]:
    def input_key(values: list[str], given: Given):
        chat = given.has("--data.apply_chat_template") or given.has("--apply_chat_template")
        if chat and given.get("--data.output_key", "--output_key") is None:
            return ["--messages_key", values[0]], None  # OpenRLHF reads a whole conversation from the input key
        return ["--input_key", values[0]], None

    return [
        *offline(), *held_out("train_sft"),
        same("--ds.use_liger_kernel", "--fused_loss", "0", meaning="`--fused_loss` (openpack's fused, chunked LM "
             "head and loss: Liger's fused linear cross-entropy, without its other kernels)"),
        ring_attn_size(),
        missing("--model.pretrain_mode_enable", "0", "the pretraining loss on raw text rows"),
        accepted("--data.multiturn", "0", "a conversation (--messages_key) trains every assistant turn", always=True),
        custom("--data.input_key", "1", ("--input_key", "--messages_key"), "`--input_key`; with "
               "`--data.apply_chat_template` and no `--data.output_key` (a whole conversation) `--messages_key`: "
               "every assistant turn trains (OpenRLHF without `--data.multiturn` trains the last message only)",
               input_key),
        same("--data.output_key", "--output_key"),
    ]


def pair_data() -> list[Twin]:
    return [same("--data.prompt_key", "--prompt_key"), same("--data.chosen_key", "--chosen_key"),
            same("--data.rejected_key", "--rejected_key")]


def dpo() -> list[Twin]:
    return [
        *offline(), *held_out("train_dpo"), *pair_data(), ring_attn_size(),
        same("--ds.use_liger_kernel", "--fused_loss", "0", meaning="`--fused_loss` (openpack's fused, chunked LM "
             "head and loss)"),
        same("--ref.offload", "--ref_offload", "0"),
        same("--model.beta", "--beta"),
        same("--model.ipo_enable", "--loss_type", "0", meaning="`--loss_type ipo`", convert=lambda _: ["ipo"]),
        same("--model.label_smoothing", "--label_smoothing"),
        same("--model.nll_loss_coef", "--nll_loss_coef"),
        same("--ref.model_name_or_path", "--ref_pretrain"),
    ]


def rm() -> list[Twin]:
    def loss_type(values: list[str], given: Given):
        if values[0] not in ("sigmoid", "logexp"):
            raise ConfigError(f"--model.loss_type {values[0]}: openpack's reward losses are sigmoid and logexp "
                              "(OpenRLHF reads any other name as logexp: write logexp)")
        return ["--loss", values[0]], None

    def eval_steps(values: list[str], given: Given):
        return ["--eval_steps", *never_is_none(values)], None

    return [
        *offline(), *pair_data(), ring_attn_size(),
        same("--ds.value_head_prefix", "--value_head_prefix"),
        accepted("--model.compute_fp32_loss_enable", "0", "openpack computes the reward loss in fp32", always=True),
        same("--model.margin_loss_enable", "--margin_key", "0", convert=lambda _: ["margin"],
             meaning="`--margin_key margin` (OpenRLHF's margin column)"),
        custom("--model.loss_type", "1", ("--loss",), "`--loss` (sigmoid, logexp)", loss_type),
        datasets("--eval.dataset", "--eval_dataset", "--eval.split"),
        split("--eval.split", "--eval.dataset", "--eval_dataset"),
        custom("--eval.steps", "1", ("--eval_steps",), "`--eval_steps`: -1 is none (before and after training; "
               "OpenRLHF evaluates once per epoch)", eval_steps),
    ]


def rl_evaluation() -> list[Twin]:
    """``--eval.*`` and ``--ckpt.best_metric_key`` of train_ppo_ray: openpack's held-out evaluation (docs/rl.md)."""
    def eval_dataset(values: list[str], given: Given):
        flags, note = datasets("--eval.dataset", "--eval_prompt_data", "--eval.split").translate(values, given)
        if len(flags) > 2:
            raise ConfigError(f"--eval.dataset {values[0]}: openpack evaluates one held-out prompt set "
                              "(--eval_prompt_data); give one file or dataset")
        return flags, note

    def eval_steps(values: list[str], given: Given):
        return ["--eval_steps", *never_is_none(values)], None

    def best_metric_key(values: list[str], given: Given):
        if values[0] in ("", "none"):
            return [], (f"--ckpt.best_metric_key {values[0] or '(empty)'}: no best checkpoint is kept (OpenRLHF's "
                        "empty value picks a pass@1 key itself; openpack keeps one only for a key named)")
        return ["--best_metric_key", values[0]], None

    return [
        custom("--eval.dataset", "1", ("--eval_prompt_data",), "`--eval_prompt_data` (one file or dataset; hub "
               "names get `@SPLIT` from `--eval.split`)", eval_dataset),
        split("--eval.split", "--eval.dataset", "--eval_prompt_data"),
        custom("--eval.steps", "1", ("--eval_steps",), "`--eval_steps`: -1 is none (before and after training only)",
               eval_steps),
        same("--eval.temperature", "--eval_temperature"),
        same("--eval.n_samples_per_prompt", "--eval_n_samples_per_prompt", meaning="`--eval_n_samples_per_prompt`: "
             "openpack's pass@k is the unbiased estimator, OpenRLHF's the best of the n samples"),
        custom("--ckpt.best_metric_key", "1", ("--best_metric_key",), "`--best_metric_key`, named as openpack logs "
               "it (`eval/reward/pass@1`, not `eval_default_pass1`); empty or `none`: no best checkpoint",
               best_metric_key),
    ]


UNUSED = "; the value is not used"
REF_PLACEMENT = "openpack keeps the reference in the policy's ranks (or, with --ref_num_nodes 1, in one actor)" + UNUSED
REWARD_PLACEMENT = "openpack runs each reward model as one Ray actor (in rank 0 with --colocate_critic_reward)" + UNUSED
CRITIC_PLACEMENT = "openpack trains the critic in the policy's ranks" + UNUSED


def num_engines(values: list[str], given: Given):
    if values == ["0"]:
        return ["--rollout_backend", "hf"], None  # OpenRLHF: "set to 0 to disable vLLM"
    return ["--rollout_backend", "vllm", "--vllm_num_engines", values[0]], None


def sync_backend(values: list[str], given: Given):
    backends = {"nccl": "nccl", "gloo": "inhost"}
    if values[0] not in backends:
        raise ConfigError(f"--vllm.sync_backend {values[0]}: openpack syncs weights by nccl or gloo (its inhost)")
    return ["--vllm_sync_backend", backends[values[0]]], None


def without_switch(name: str, switch: str, flag: str, nothing: str = "no correction") -> Translate:
    """``name`` sets ``flag`` only with OpenRLHF's enable ``switch`` given; without it, as in OpenRLHF, nothing
    (said at start)."""
    def translate(values: list[str], given: Given):
        if not given.has(switch):
            return [], f"{name} {' '.join(values)}: {nothing}, as in OpenRLHF without {switch}"
        return [flag, *values], None
    return translate


is_correction_type = without_switch("--algo.advantage.is_correction_type", "--algo.advantage.is_correction_enable",
                                    "--is_correction_type")
is_correction_threshold = without_switch("--algo.advantage.is_correction_threshold",
                                         "--algo.advantage.is_correction_enable", "--is_correction_threshold")


def is_correction_enable(values: list[str], given: Given):
    if given.has("--algo.advantage.is_correction_type"):
        return [], None  # the type sets it
    return ["--is_correction_type", "tis"], None  # OpenRLHF's default type


async_queue_size = without_switch("--train.async_queue_size", "--train.async_enable", "--max_staleness",
                                  "nothing to queue")


def dynamic_filtering(values: list[str], given: Given):
    low_high = given.get("--algo.dynamic_filtering_range") or ["0", "1"]  # OpenRLHF's default range
    return ["--dynamic_filtering", "--dynamic_filtering_reward_range", *low_high], None


def dynamic_filtering_range(values: list[str], given: Given):
    if not given.has("--algo.dynamic_filtering_enable"):
        return [], "--algo.dynamic_filtering_range: no filtering, as in OpenRLHF without " \
                   "--algo.dynamic_filtering_enable"
    return [], None  # --algo.dynamic_filtering_enable sets it


def dynamic_batch(values: list[str], given: Given):
    return ["--packing_samples", "--use_dynamic_batch"], None  # OpenRLHF turns packing on for it


def max_len(values: list[str], given: Given):
    """OpenRLHF 0.11: ``--data.max_len`` is a prompt's and its completion's budget together; with
    ``--rollout.max_new_tokens N`` a completion gets N and the prompt the rest, without it a completion gets what
    its prompt leaves (``max(1, max_len - prompt_len)``, ``utils/agent.py``); an agent's episode is cut at it."""
    total = int(values[0])
    new_tokens = given.get("--rollout.max_new_tokens")
    prompt_flags = []
    if new_tokens is not None:
        prompt = total - int(new_tokens[0])
        if prompt < 1:
            raise ConfigError(f"--data.max_len {values[0]} leaves no room for a prompt beside "
                              f"--rollout.max_new_tokens {new_tokens[0]}; raise it")
        prompt_flags = ["--prompt_max_len", str(prompt)]
    if given.has("--train.agent_func_path"):  # OpenRLHF's agent turns each get what the episode has left of it
        return ["--max_episode_tokens", values[0], *prompt_flags], None
    if prompt_flags:
        return prompt_flags, None
    if total < 2:
        raise ConfigError(f"--data.max_len {values[0]} leaves no room for a prompt and a completion; raise it")
    return ["--max_len", values[0], "--prompt_max_len", str(total - 1), "--generate_max_len", values[0]], None


def max_new_tokens(values: list[str], given: Given):
    return ["--generate_max_len", values[0]], None


def openpack_default(flag: str) -> list[str]:
    """The value train_ppo gives ``flag`` when no flag sets it, as typed (train_grpo's is the same for the flags
    compared here: batch sizes, token caps and the optimizer's settings)."""
    import dataclasses

    from openpack.config.rl import PPORunConfig

    for section in PPORunConfig.section_classes():
        for f in dataclasses.fields(section):
            if f.name == flag.removeprefix("--"):
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    raise KeyError(flag)


def like_train(name: str, nargs: str, train_flags: tuple[str, str], feature: str) -> Twin:
    """A flag for which openpack has one value where OpenRLHF has two: accepted where it equals the one the run
    gets (``train_flags``: its OpenRLHF name, then openpack's, then openpack's default), else refused."""
    def translate(values: list[str], given: Given):
        own = given.get(*train_flags) or openpack_default(train_flags[1])
        if _numbers(values) == _numbers(own):
            return [], f"{name} {' '.join(values)}: the same as {train_flags[0]}, as openpack has one for both"
        raise ConfigError(f"{name} {' '.join(values)}: {feature} is not in openpack; this run's {train_flags[0]} "
                          f"is {' '.join(own)}: give the same, or drop {name} (an OpenRLHF 0.11 flag; "
                          "docs/openrlhf.md)")
    return Twin(name, nargs, "refused", (), f"accepted where it equals `{train_flags[0]}`; else refused: "
                f"{feature}", translate)


def critic_like_actor(setting: str, nargs: str, flat: str) -> Twin:
    return like_train(f"--critic.{setting}", nargs, (f"--actor.{setting}", flat),
                      "optimizer settings of the critic's own (it takes the policy's, but for --critic.adam.lr)")


def rl() -> list[Twin]:
    return [
        *shared(),
        accepted("--ref.num_nodes", "1", REF_PLACEMENT),
        accepted("--ref.num_gpus_per_node", "1", REF_PLACEMENT),
        accepted("--reward.num_nodes", "1", REWARD_PLACEMENT),
        accepted("--reward.num_gpus_per_node", "1", REWARD_PLACEMENT),
        accepted("--critic.num_nodes", "1", CRITIC_PLACEMENT),
        accepted("--critic.num_gpus_per_node", "1", CRITIC_PLACEMENT),
        accepted("--train.colocate_actor_ref", "0", "the reference lives in the policy's ranks", always=True),
        same("--actor.num_nodes", "--num_nodes"),
        same("--actor.num_gpus_per_node", "--num_gpus_per_node"),
        same("--train.colocate_critic_reward", "--colocate_critic_reward", "0"),
        same("--train.colocate_all", "--colocate_all_models", "0"),
        custom("--vllm.num_engines", "1", ("--rollout_backend", "--vllm_num_engines"),
               "`--rollout_backend vllm --vllm_num_engines N`; 0 is `--rollout_backend hf`", num_engines),
        same("--vllm.tensor_parallel_size", "--vllm_tensor_parallel_size"),
        custom("--vllm.sync_backend", "1", ("--vllm_sync_backend",), "`--vllm_sync_backend`: nccl is `nccl`, gloo "
               "is `inhost` (weights through the host, not a gloo group)", sync_backend),
        accepted("--vllm.sync_with_ray", "0", "openpack's weight sync goes by --vllm.sync_backend (no Ray "
                 "collective group)"),
        accepted("--vllm.enable_prefix_caching", "0", "openpack's vLLM engines cache prefixes", always=True),
        accepted("--vllm.enforce_eager", "0", "openpack's vLLM engines run eagerly (no CUDA graphs)", always=True),
        accepted("--vllm.enable_sleep", "0", "with --train.colocate_all openpack puts vLLM to sleep while DeepSpeed "
                 "trains (without it there is nothing to share)", always=True),
        accepted("--ds.enable_sleep", "0", "with --train.colocate_all openpack offloads DeepSpeed's states while "
                 "vLLM generates", always=True),
        same("--vllm.gpu_memory_utilization", "--vllm_gpu_memory_utilization"),
        custom("--algo.advantage.is_correction_enable", "0", ("--is_correction_type",),
               "`--is_correction_type tis` (OpenRLHF's default type), or the type given", is_correction_enable),
        custom("--algo.advantage.is_correction_threshold", "2", ("--is_correction_threshold",),
               "`--is_correction_threshold`, with the enable switch (without it: no correction, said at start)",
               is_correction_threshold),
        custom("--algo.advantage.is_correction_type", "1", ("--is_correction_type",),
               "`--is_correction_type`, with the enable switch (without it: no correction, said at start)",
               is_correction_type),
        same("--train.async_enable", "--async_train", "0"),
        custom("--train.async_queue_size", "1", ("--max_staleness",), "`--max_staleness` (rollout batches ahead), "
               "with `--train.async_enable`", async_queue_size),
        same("--train.partial_rollout_enable", "--partial_rollout", "0"),
        *rl_evaluation(),
        same("--actor.gradient_checkpointing_enable", "--gradient_checkpointing", "0"),
        missing("--actor.gradient_checkpointing_reentrant", "0", "reentrant activation checkpointing (openpack's is "
                "non-reentrant)"),
        missing("--train.enable_ema", "0", "an exponential moving average of the policy's weights"),
        missing("--train.ema_beta", "1", "an exponential moving average of the policy's weights", off=("0.992",)),
        missing("--ds.use_liger_kernel", "0", "Liger kernels in RL"),
        custom("--train.dynamic_batch_enable", "0", ("--packing_samples", "--use_dynamic_batch"),
               "`--packing_samples --use_dynamic_batch` (OpenRLHF turns packing on with it)", dynamic_batch),
        accepted("--rollout.max_tokens_per_gpu", "1", "openpack's experience passes (old policy, reference, critic) "
                 "pack under the training cap, --train.max_tokens_per_gpu: the same numbers, in rows of that size "
                 "(a speed and memory knob of OpenRLHF's forward-only passes" + UNUSED + ")"),
        same("--train.max_tokens_per_gpu", "--max_tokens_per_gpu"),
        same("--train.num_episodes", "--num_episodes"),
        same("--rollout.batch_size", "--rollout_batch_size"),
        like_train("--rollout.vllm_generate_batch_size", "1", ("--rollout.batch_size", "--rollout_batch_size"),
                   "over-sampling prompts beyond a rollout batch"),
        same("--rollout.micro_batch_size", "--micro_rollout_batch_size", meaning="`--micro_rollout_batch_size` "
             "(prompts per HF generate call; OpenRLHF's batches the experience passes, which openpack batches as "
             "it trains)"),
        custom("--data.max_len", "1", ("--max_len", "--prompt_max_len", "--generate_max_len", "--max_episode_tokens"),
               "alone: `--max_len L --prompt_max_len L-1 --generate_max_len L` (a completion gets what its prompt "
               "leaves of L); with `--rollout.max_new_tokens N`: `--prompt_max_len` L - N; with "
               "`--train.agent_func_path`: `--max_episode_tokens` L (and that `--prompt_max_len`). A longer prompt is left out and counted "
               "(OpenRLHF cuts it from the left)", max_len),
        custom("--rollout.max_new_tokens", "1", ("--generate_max_len",), "`--generate_max_len`", max_new_tokens),
        same("--actor.eps_clip", "--eps_clip"),
        same("--actor.eps_clip_low_high", "--eps_clip_low_high", "2"),
        same("--actor.dual_clip", "--dual_clip"),
        same("--critic.value_clip", "--value_clip"),
        same("--algo.advantage.lambd", "--lambd"),
        same("--algo.advantage.gamma", "--gamma"),
        accepted("--reward.normalize_enable", "0", "openpack scores with a reward model's saved mean and std "
                 "whenever it has them (without this flag OpenRLHF does not)", always=True),
        same("--rollout.top_p", "--top_p"),
        same("--rollout.temperature", "--temperature"),
        same("--critic.freezing_steps", "--freezing_actor_steps", convert=lambda v: ["0"] if v == ["-1"] else v,
             meaning="`--freezing_actor_steps`: -1 (none) is 0"),
        same("--rollout.n_samples_per_prompt", "--n_samples_per_prompt"),
        accepted("--critic.save_value_network", "0", "openpack saves the critic in <save_path>/critic", always=True),
        same("--algo.kl.target", "--target_kl"),
        same("--algo.kl.horizon", "--kl_horizon"),
        same("--algo.kl.init_coef", "--init_kl_coef"),
        same("--actor.policy_loss_type", "--policy_loss_type"),
        same("--algo.kl.estimator", "--kl_estimator"),
        same("--actor.aux_loss_coef", "--aux_loss_coef", meaning="`--aux_loss_coef` (0: no MoE balancing loss)"),
        same("--actor.entropy_coef", "--entropy_coef", meaning="`--entropy_coef` (openpack logs the entropy always)"),
        same("--reward.clip_range", "--reward_clip_range", "2", meaning="`--reward_clip_range` (with "
             "`--per_turn_reward`, each turn's reward)"),
        *optimizer("actor", "--learning_rate"),
        missing("--critic.optim", "1", MUON, off=("adam",)),
        *[missing(f"--critic.muon.{name}", "0" if "nesterov" in name else "1", MUON)
          for name in ("lr", "momentum", "ns_steps", "nesterov", "no_nesterov")],
        same("--critic.adam.lr", "--critic_learning_rate"),
        critic_like_actor("adam.betas", "2", "--adam_betas"),
        critic_like_actor("adam.eps", "1", "--adam_epsilon"),
        critic_like_actor("adam.weight_decay", "1", "--weight_decay"),
        critic_like_actor("lr_scheduler", "1", "--lr_scheduler"),
        critic_like_actor("lr_warmup_ratio", "1", "--lr_warmup_ratio"),
        critic_like_actor("min_lr_ratio", "1", "--min_lr_ratio"),
        critic_like_actor("max_norm", "1", "--max_norm"),
        same("--algo.advantage.estimator", "--advantage_estimator"),
        same("--algo.kl.use_loss", "--use_kl_loss", "0"),
        missing("--algo.advantage.no_std_norm", "0", "REINFORCE advantages centred without dividing by their std"),
        same("--reward.overlong_buffer_len", "--overlong_buffer_len", convert=_whole,
             meaning="`--overlong_buffer_len` (a whole number of tokens)"),
        same("--reward.overlong_penalty_factor", "--overlong_penalty_factor"),
        same("--reward.stop_properly_penalty_coef", "--stop_properly_penalty_coef"),
        missing("--ds.ring_attn_size", "1", "context parallelism in RL (train_sft, train_dpo and train_rm have it)",
                off=("1",)),
        same("--actor.model_name_or_path", "--pretrain"),
        same("--reward.model_name_or_path", "--reward_pretrain", convert=comma_list,
             meaning="`--reward_pretrain`: `a,b` is `a b` (summed; OpenRLHF sums them too)"),
        custom("--reward.remote_url", "1", ("--remote_rm_url",), "`--remote_rm_url URL` (the same JSON protocol), or "
               "`--remote_rm_url file.py` (OpenRLHF's `reward_func(queries, prompts, labels)`, called as OpenRLHF "
               "calls it, one query a call; `openrlhf.utils`' math helpers importable without openrlhf); several "
               "URLs refused (one server per run)", remote_url),
        same("--critic.model_name_or_path", "--critic_pretrain"),
        missing("--ds.value_head_prefix", "1", "reward models with another head name in RL (save them with "
                "openpack train_rm, or under score)", off=("score",)),
        missing("--ref.offload", "0", "offloading the RL reference model to CPU"),
        missing("--reward.offload", "0", "offloading reward models to CPU"),
        same("--train.agent_func_path", "--agent_func_path"),
        datasets("--data.prompt_dataset", "--prompt_data", "--data.prompt_split"),
        same("--data.prompt_probs", "--prompt_data_probs", convert=comma_list,
             meaning="`--prompt_data_probs`: `a,b` is `a b`"),
        split("--data.prompt_split", "--data.prompt_dataset", "--prompt_data"),
        same("--data.input_key", "--input_key"),
        same("--data.label_key", "--label_key"),
        custom("--algo.dynamic_filtering_enable", "0", ("--dynamic_filtering", "--dynamic_filtering_reward_range"),
               "`--dynamic_filtering --dynamic_filtering_reward_range LOW HIGH` (OpenRLHF's range, default 0 1)",
               dynamic_filtering),
        custom("--algo.dynamic_filtering_range", "2", ("--dynamic_filtering_reward_range",),
               "`--dynamic_filtering_reward_range`, with the enable switch", dynamic_filtering_range),
        accepted("--data.image_key", "1", "text-only prompts: no images to read (the value is not used)"),
        missing("--data.max_images_per_prompt", "1", "vision-language models", off=("0",)),
        missing("--actor.freeze_visual_encoder", "0", "vision-language models"),
    ]


def remote_url(values: list[str], given: Given):
    urls = comma_list(values)
    if len(urls) > 1:
        raise ConfigError(f"--reward.remote_url {values[0]}: several reward servers sharing a batch are not in "
                          "openpack; give one URL (an OpenRLHF 0.11 flag; docs/openrlhf.md)")
    return ["--remote_rm_url", urls[0]], None


def _numbers(values: list[str]) -> list:
    """Values compared as numbers where they are numbers ('1e-8' == '1e-08')."""
    def one(value: str):
        try:
            return float(value)
        except ValueError:
            return SCHEDULERS.get(value, value)
    return [one(v) for v in values]


def _whole(values: list[str]) -> list[str]:
    """OpenRLHF's float token count as openpack's int (1024.0 -> 1024)."""
    number = float(values[0])
    if not number.is_integer():
        raise ConfigError(f"--reward.overlong_buffer_len {values[0]}: a number of tokens, so a whole number")
    return [str(int(number))]


def _table(twins: list[Twin]) -> dict[str, Twin]:
    table: dict[str, Twin] = {}
    for twin in twins:
        if twin.name in table:
            raise ValueError(f"{twin.name} is in the table twice")
        table[twin.name] = twin
    return table


TABLES = {"train_sft": _table(sft()), "train_dpo": _table(dpo()), "train_rm": _table(rm()),
          "train_ppo": _table(rl())}
TABLES["train_grpo"] = TABLES["train_ppo"]


# ---------------------------------------------------------------------------------------------- defaults

# The OpenRLHF 0.11 defaults openpack keeps its own of, each with why (one line). Every other default is
# OpenRLHF's (issue 41); test_openrlhf_flags.py compares both sides' defaults with this list, so a default that
# comes to differ, on either side, fails there until it is adopted or given a reason here. docs/openrlhf.md shows it.
WHY = {
    "--ckpt.path": "none: `<save_path>/checkpoints`, so a run's checkpoints stay in its own folder, with its lock "
                   "and manifests",
    "--ds.param_dtype": "fp32 unless `--bf16`: openpack runs on a CPU by default (the demos, CI), where its runs "
                        "and equality checks are fp32",
    "--ds.attn_implementation": "`auto` takes flash-attn where it is installed and an exact kernel elsewhere; "
                                "OpenRLHF's default stops without flash-attn",
    "--model.aux_loss_coef": "none: the MoE config's own `router_aux_loss_coef`, so MoE models train with their "
                             "balancing loss (0 leaves it out; docs/models.md)",
    "--data.max_samples": "none reads every row; openpack's cap is over all datasets together, OpenRLHF's per "
                          "dataset",
    "--logger.wandb.project": "named after the tool, as OpenRLHF names its own",
    "--logger.wandb.run_name": "none lets W&B name the run; a name from the launch time would change "
                               "`config.yaml` on every resume",
    "--ckpt.save_hf": "always: every checkpoint holds a Hugging Face model folder as well as the DeepSpeed state",
    "--train.micro_batch_size": "1: a padded micro-batch pads each row to its longest; on ANCHORS' length mix 8 "
                                "pairs compute 2.43x the real tokens, 1 pair 1.23x (docs/benchmarks.md); packed "
                                "runs (`--use_dynamic_batch`) ignore it",
    "--data.input_key": "`prompt`, TRL's key and the demos'; OpenRLHF's example scripts all name their key",
    "--data.output_key": "`response`: OpenRLHF's none trains nothing outside its pretraining mode "
                         "(`--model.pretrain_mode_enable`, refused here)",
    "--data.multiturn": "always: a conversation trains every assistant turn (TRL's `assistant_only_loss`); one "
                        "with a single answer at its end trains the same either way",
    "--data.prompt_key": "`prompt`, TRL's key; a row without it holds two whole conversations whose shared start "
                         "is the prompt (TRL's implicit prompt)",
    "--model.compute_fp32_loss_enable": "always: the reward loss is computed in fp32 (two scalars a pair)",
    "--actor.num_gpus_per_node": "1: a default that runs on any machine (one GPU, or a CPU); 8 needs an 8-GPU node",
    "--vllm.num_engines": "`--rollout_backend auto`: one vLLM engine where vLLM imports, else HF generate; "
                          "OpenRLHF's none turns vLLM off",
    "--vllm.sync_backend": "`inhost` runs everywhere (the CPU path CI tests); the NCCL broadcast has not run on "
                           "hardware yet (docs/rl.md)",
    "--train.max_tokens_per_gpu": "none: a row cap from the model's size and the device's memory, logged at start "
                                  "(docs/rl.md, Row cap)",
    "--rollout.micro_batch_size": "another meaning: prompts per HF generate call (OpenRLHF's batches the "
                                  "experience passes); 1 would generate one prompt at a time",
    "--data.max_len": "none (`--max_len`): a prompt and its completion each have their own budget "
                      "(`--prompt_max_len`, `--generate_max_len`, 1024 each), which the demos and tests are sized "
                      "by; `--max_len L` is OpenRLHF's shared one",
    "--rollout.max_new_tokens": "1024 (`--generate_max_len`): OpenRLHF's none gives a completion what its prompt "
                                "leaves of `--data.max_len`, which openpack does under `--max_len`",
    "--actor.aux_loss_coef": "none: the MoE config's own `router_aux_loss_coef`, so MoE models train with their "
                             "balancing loss (0 leaves it out; docs/models.md)",
    "--train.colocate_actor_ref": "always: the reference lives in the policy's ranks (no devices of its own; "
                                  "results do not depend on placement)",
    "--vllm.enable_prefix_caching": "always: the n completions of a prompt share its KV cache (vLLM's own default)",
    "--vllm.enforce_eager": "always: no CUDA graphs, as OpenRLHF's own example scripts run its engines",
    "--vllm.enable_sleep": "always under `--colocate_all_models`: vLLM sleeps while DeepSpeed trains, so the two "
                           "fit on one device",
    "--ds.enable_sleep": "always under `--colocate_all_models`: DeepSpeed's states leave the device while vLLM "
                         "generates",
    "--reward.normalize_enable": "always: a reward model's saved mean and std apply (`train_rm "
                                 "--normalize_reward`); the PPO demo's reward model depends on it",
    "--critic.save_value_network": "always: the critic is exported to `<save_path>/critic` at the end",
}
WHY_GRPO = {  # train_grpo is train_ppo with GRPO's defaults (config/rl.py); OpenRLHF has no such command
    "--algo.advantage.estimator": "`group_norm`: train_grpo is critic-free (train_ppo's is OpenRLHF's `gae`)",
    "--rollout.n_samples_per_prompt": "8: a GRPO group compares several completions of a prompt (train_ppo's is "
                                      "OpenRLHF's 1)",
    "--algo.kl.init_coef": "0, TRL's GRPO default: no reference model is loaded (train_ppo's is OpenRLHF's 0.01)",
}
OFFLINE_KEPT = ("--ckpt.path", "--ds.param_dtype", "--ds.attn_implementation", "--model.aux_loss_coef",
                "--data.max_samples", "--logger.wandb.project", "--logger.wandb.run_name", "--ckpt.save_hf")
KEPT_DEFAULTS: dict[str, dict[str, str]] = {  # command -> OpenRLHF 0.11 flag -> why openpack's default differs
    command: {flag: WHY[flag] for flag in flags} for command, flags in {
        "train_sft": (*OFFLINE_KEPT, "--train.micro_batch_size", "--data.input_key", "--data.output_key",
                      "--data.multiturn"),
        "train_dpo": (*OFFLINE_KEPT, "--train.micro_batch_size", "--data.prompt_key"),
        "train_rm": (*OFFLINE_KEPT, "--data.prompt_key", "--model.compute_fp32_loss_enable"),
        "train_ppo": ("--ckpt.path", "--ds.param_dtype", "--ds.attn_implementation", "--data.max_samples",
                      "--logger.wandb.project", "--logger.wandb.run_name", "--ckpt.save_hf",
                      "--actor.num_gpus_per_node", "--vllm.num_engines", "--vllm.sync_backend",
                      "--train.max_tokens_per_gpu", "--rollout.micro_batch_size", "--data.max_len",
                      "--rollout.max_new_tokens", "--actor.aux_loss_coef", "--data.input_key",
                      "--train.colocate_actor_ref", "--vllm.enable_prefix_caching", "--vllm.enforce_eager",
                      "--vllm.enable_sleep", "--ds.enable_sleep", "--reward.normalize_enable",
                      "--critic.save_value_network"),
    }.items()}
KEPT_DEFAULTS["train_grpo"] = {**KEPT_DEFAULTS["train_ppo"], **WHY_GRPO}


# ---------------------------------------------------------------------------------------------- translation


@dataclass(frozen=True)
class Translation:
    argv: list[str]  # in openpack's names
    notes: list[str]  # the accepted flags, each said once at start


def _items(argv: list[str], table: dict[str, Twin]) -> list[tuple[str | None, list[str]]]:
    """``argv`` cut at each ``--flag`` (``--flag=value`` split): (flag, values); tokens before any flag come with
    None. An OpenRLHF flag takes its declared number of values ("*": up to the next flag); any other takes the
    tokens up to the next flag, for ``Given`` only (they pass through as typed)."""
    items: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            items.append((None, [token]))
            continue
        flag, eq, inline = token.partition("=")
        values = [inline] if eq else []
        twin = table.get(flag)
        want = None if twin is None or twin.nargs == "*" else int(twin.nargs)
        while i < len(argv) and not argv[i].startswith("--") and (want is None or len(values) < want):
            values.append(argv[i])
            i += 1
        items.append((flag, values))
    return items


def translate(command: str, argv: list[str]) -> Translation:
    """``argv`` with every OpenRLHF 0.11 flag of ``command`` replaced by the openpack flags that mean the same.

    Raises ConfigError (one line naming the flag) for a flag whose feature openpack lacks or whose value it cannot
    take. Flags in openpack's names, and anything else, pass through as typed.
    """
    table = TABLES.get(command, {})
    items = _items(argv, table)
    if not any(flag in table for flag, _ in items):
        return Translation(list(argv), [])
    given = Given(items)
    out: list[str] = []
    notes: list[str] = []
    for flag, values in items:
        twin = table.get(flag) if flag else None
        if twin is None:
            out += ([flag] if flag else []) + values
            continue
        tokens, note = twin.translate(_values(flag, values, twin.nargs), given)
        out += tokens
        if note:
            notes.append(note)
    return Translation(out, notes)


def help_names(command: str) -> dict[str, list[str]]:
    """openpack field -> the OpenRLHF 0.11 flags that set it, for ``--help``."""
    names: dict[str, list[str]] = {}
    for twin in TABLES.get(command, {}).values():
        for flag in twin.sets:
            names.setdefault(flag.removeprefix("--"), []).append(twin.name)
    return names


def help_epilog(command: str) -> str | None:
    """What ``--help`` says of the OpenRLHF 0.11 flags besides each field's twin: those accepted and those
    refused."""
    table = TABLES.get(command)
    if not table:
        return None
    kinds = {kind: [t.name for t in table.values() if t.kind == kind] for kind in ("accepted", "refused")}
    lines = [("OpenRLHF 0.11 flags: each flag above names its OpenRLHF twin (e.g. --pretrain, "
              "--model.model_name_or_path); both names work and give the same config.yaml."),
             "accepted, nothing to set (openpack does this already, or it is not used in this run): "
             + " ".join(kinds["accepted"]),
             "refused (openpack lacks the feature), or accepted at the value that leaves it off: "
             + " ".join(kinds["refused"]),
             "What each means, and the values whose meaning differs: docs/openrlhf.md"]
    return "\n".join(textwrap.fill(line, 100, initial_indent="  " * bool(i), subsequent_indent="    ")
                     for i, line in enumerate(lines))
