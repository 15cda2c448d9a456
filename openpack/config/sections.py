"""The sections every training command shares (model, data source, training, output, launch), with the checks
that span them.

``train_sft``, ``train_dpo``, ``train_rm``, ``train_ppo`` and ``train_grpo`` build their run configs from these
classes (each command's own sections subclass or sit beside them), so a flag such as ``--zero_stage`` has one
name, one help string and one range in every command. A check that reads several sections of one command sits in
that command's module; the ones here are shared by several commands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from openpack.config.schema import ConfigError, arg
from openpack.models.attention import BACKENDS
from openpack.orchestration.launch import launched_by_environment


@dataclass
class ModelConfig:
    pretrain: str | None = arg(None, "HF model name or path; none: the built-in demo model")
    bf16: bool = arg(False, "train in bfloat16 (fp32 master weights in the optimizer)")
    gradient_checkpointing: bool = arg(False, "recompute activations in the backward to save memory")
    attn_backend: str = arg("auto", "packed attention backend; auto picks by device and dtype", choices=BACKENDS)
    zero_stage: int = arg(2, "DeepSpeed ZeRO stage", choices=[0, 1, 2, 3])
    adam_offload: bool = arg(False, "offload optimizer states to CPU (ZeRO stage >= 1)")
    param_offload: bool = arg(False, "offload parameters to CPU (ZeRO stage 3)")
    lora_rank: int = arg(0, "LoRA rank: train low-rank adapters (peft) instead of every weight; the saved model is "
                         "merged, the adapter alone goes to <save_path>/adapter", at_least=0,
                         special={0: "no LoRA, every weight trains"})
    lora_alpha: int = arg(16, "LoRA scaling numerator: adapters add (lora_alpha / lora_rank) B A", above=0)
    lora_dropout: float = arg(0.0, "dropout on the LoRA input", at_least=0, below=1)
    target_modules: list[str] = arg(["all-linear"], "modules that get adapters, by name (e.g. q_proj v_proj); "
                                    "all-linear: every linear layer but the output head")
    load_in_4bit: bool = arg(False, "QLoRA: the frozen base weights in 4-bit NF4 (bitsandbytes, CUDA GPU); "
                             "needs --lora_rank")
    aux_loss_coef: float | None = arg(None, "MoE models: weight of the router load-balancing loss added to the "
                                      "policy's loss (sets, and saves, the config's router_aux_loss_coef)",
                                      at_least=0, special={None: "the model config's router_aux_loss_coef"})

    def validate(self):
        check_lora_flags(self)


def check_attention_backend(model: ModelConfig, launch=None) -> None:
    """An --attn_backend this environment lacks (flash-attn not installed) is refused in the driver, before Ray or
    any worker starts; here, not in ``validate``, so that parsing a command line needs no kernel installed.
    Not when the ranks run on a Ray cluster elsewhere (``--ray_address`` or ``$RAY_ADDRESS``): a CPU head node
    without flash-attn drives GPU workers that have it."""
    from openpack.models.attention import unavailable_backend

    if launch is not None and launch.launcher == "ray" and (launch.ray_address or os.environ.get("RAY_ADDRESS")):
        return
    reason = unavailable_backend(model.attn_backend)
    if reason:
        raise ConfigError(reason)


def check_lora_flags(model: ModelConfig) -> None:
    """--load_in_4bit only with adapters, and only where bitsandbytes runs: refused before any model loads."""
    if not model.load_in_4bit:
        return
    if not model.lora_rank:
        raise ConfigError("--load_in_4bit freezes the base in 4 bits and trains LoRA adapters on it: give "
                          "--lora_rank (e.g. 16)")
    if model.zero_stage == 3:
        raise ConfigError("--load_in_4bit with --zero_stage 3 is not supported here (4-bit weights are not "
                          "partitioned); use --zero_stage 2")
    from openpack.models.lora import LoRAUnavailable, check_4bit_available

    try:
        check_4bit_available()
    except LoRAUnavailable as err:
        raise ConfigError(str(err)) from err


def data_cache_dir_arg():
    """--data_cache_dir, in every command's data section (docs/sft.md, "Large datasets")."""
    return arg(None, "where the rows' tokenized lengths are cached, keyed by the data files' sha256, the tokenizer, "
               "the template and the length flags: a second run or a resume tokenizes nothing",
               special={None: "$OPENPACK_CACHE/data, else ~/.cache/openpack/data"})


def dataset_num_proc_arg():
    """--dataset_num_proc, in every command's data section."""
    return arg(None, "processes that tokenize the rows for their lengths (TRL's dataset_num_proc)", at_least=1,
               special={None: "every core this process may use"})


@dataclass
class DatasetConfig:
    """Where rows come from and how many; shared by every training command."""

    dataset: list[str] | None = arg(None, "HF dataset names or local .json/.jsonl/.parquet files or folders")
    dataset_probs: list[float] | None = arg(None, "sampling probability of each --dataset (sums to 1)", above=0,
                                            special={None: "the datasets are concatenated in order"})
    max_len: int = arg(2048, "max tokens per sequence (prompt + response)", at_least=2)
    overlength_policy: str = arg("truncate", "sequences over --max_len", choices=["truncate", "drop", "error"])
    skip_bad_samples: bool = arg(False, "skip and count malformed rows instead of stopping with an error")
    max_samples: int | None = arg(None, "use at most this many samples", at_least=1, special={None: "every sample"})
    data_cache_dir: str | None = data_cache_dir_arg()
    dataset_num_proc: int | None = dataset_num_proc_arg()


def check_template_flags(input_template: str | None, apply_chat_template: bool) -> None:
    """--input_template holds {} and real newlines, and is not combined with --apply_chat_template."""
    from openpack.data.formats import check_input_template
    from openpack.data.loading import DataError

    try:
        check_input_template(input_template, apply_chat_template)
    except DataError as err:
        raise ConfigError(str(err)) from err


@dataclass
class TrainConfig:
    packing_samples: bool = arg(False, "pack several samples into each row (attention isolated per sample)")
    use_dynamic_batch: bool = arg(False, "with --packing_samples: micro-batches are rows of <= --max_tokens_per_gpu tokens")
    max_tokens_per_gpu: int = arg(16384, "token cap of a packed row under --use_dynamic_batch", at_least=2)
    micro_train_batch_size: int = arg(1, "samples per micro-batch without --use_dynamic_batch", at_least=1)
    train_batch_size: int = arg(128, "samples per optimizer step, over all ranks", at_least=1)
    max_epochs: int = arg(1, "passes over the data", at_least=1)
    max_steps: int | None = arg(None, "stop after this many optimizer steps", at_least=1,
                                special={None: "train every step of --max_epochs epochs"})
    learning_rate: float = arg(5e-6, "peak learning rate (AdamW)", above=0)
    lr_scheduler: str = arg("cosine", "schedule after warmup", choices=["cosine", "linear", "constant"])
    lr_warmup_ratio: float = arg(0.03, "share of steps spent warming up linearly", at_least=0, at_most=1)
    min_lr_ratio: float = arg(0.1, "final learning rate as a share of the peak (cosine, linear)", at_least=0,
                              at_most=1)
    weight_decay: float = arg(0.0, "AdamW weight decay (not on biases and norms)", at_least=0)
    adam_betas: list[float] = arg([0.9, 0.95], "AdamW betas", at_least=0, below=1)
    adam_epsilon: float = arg(1e-8, "AdamW epsilon, added to the root of the second moment (TRL's adam_epsilon)",
                              above=0)
    max_norm: float = arg(1.0, "gradient clipping norm", at_least=0, special={0.0: "no gradient clipping"})
    max_nonfinite_steps: int | None = arg(None, "stop the run (exit 1) after this many optimizer steps in a row whose "
                                          "loss or gradient norm is inf or NaN; each such step is skipped on every "
                                          "rank (no update) and counted", at_least=1,
                                          special={None: "3 in a row stop the run"})
    seed: int = arg(42, "seed for data order and initialisation", at_least=0)

    def validate(self):
        if self.use_dynamic_batch and not self.packing_samples:
            raise ConfigError("--use_dynamic_batch needs --packing_samples (dynamic micro-batches are packed rows)")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"--adam_betas takes two numbers, got {self.adam_betas}")


def ring_attn_size_arg():
    """--ring_attn_size, in the train section of each command that splits packed rows over ranks (train_sft,
    train_dpo, train_rm, and the training-side passes of train_ppo and train_grpo; checked by
    ``check_context_parallel``)."""
    return arg(None, "context parallelism: this many ranks share each packed row (each holding up to "
               "--max_tokens_per_gpu of it; data parallelism is the world size over this); needs --packing_samples",
               at_least=1, special={None: "no context parallelism (as 1)"})


def packed_row_tokens(train: TrainConfig) -> tuple[int, str]:
    """The most tokens a packed row holds, and its flags in words: --max_tokens_per_gpu, times --ring_attn_size N
    where N ranks share a row."""
    ring = getattr(train, "ring_attn_size", None) or 1
    if ring == 1:
        return train.max_tokens_per_gpu, f"--max_tokens_per_gpu {train.max_tokens_per_gpu}"
    return (train.max_tokens_per_gpu * ring,
            f"--max_tokens_per_gpu {train.max_tokens_per_gpu} x --ring_attn_size {ring} (a row's tokens)")


def check_context_parallel(train: TrainConfig, launch_cfg: LaunchConfig) -> None:
    """--ring_attn_size N splits packed rows over N ranks: it needs --packing_samples and a world size N divides."""
    world, ring = planned_world_size(launch_cfg), train.ring_attn_size or 1
    if ring > 1 and not train.packing_samples:
        raise ConfigError(f"--ring_attn_size {ring} needs --packing_samples: context parallelism splits packed rows "
                          "over ranks")
    if ring > 1 and world % ring:
        raise ConfigError(f"--ring_attn_size {ring} needs a world size it divides (the run has {world} rank(s)): "
                          "each group of that many ranks shares its rows")


FUSED_LOSS_HELP = ("compute the LM head, the loss and their gradients in one pass, each chunk's logits once instead "
                   "of twice: 3 vocabulary-sized matmuls per token instead of 4, same numbers (docs/benchmarks.md)")


@dataclass
class OutputConfig:
    save_path: str = arg("./ckpt", "folder of one run (OpenRLHF's default): config.yaml, metrics.jsonl, loss.png, "
                         "the final model (a new run into another run's folder is refused; see --load_checkpoint, "
                         "--overwrite)")
    save_steps: int | None = arg(None, "checkpoint every N steps (always at the end)", at_least=1,
                                 special={None: "a checkpoint at the end only"})
    ckpt_path: str | None = arg(None, "folder of DeepSpeed checkpoints; default <save_path>/checkpoints")
    max_ckpt_num: int = arg(3, "checkpoints of this run to keep", at_least=1)
    load_checkpoint: bool = arg(False, "resume the run in --save_path from its latest checkpoint, if any (exactly: "
                                "a change of data order, world size or ZeRO layout is refused)")
    load_checkpoint_tag: str | None = arg(None, "resume from this checkpoint (e.g. global_step4) instead of the latest; "
                                          "implies --load_checkpoint")
    overwrite: bool = arg(False, "start a new run in --save_path even if another run's checkpoints or model are "
                          "there: they are deleted first (ignored with --load_checkpoint, which resumes that run)")
    logging_steps: int = arg(1, "log metrics every N steps (and the last)", at_least=1)
    use_wandb: str | None = arg(None, "W&B API key, or 'offline' to log locally without network")
    wandb_project: str = arg("openpack", "W&B project")
    wandb_run_name: str | None = arg(None, "W&B run name")
    use_tensorboard: str | None = arg(None, "TensorBoard log folder")


@dataclass
class LaunchConfig:
    launcher: str = arg("ray", "ray: one Ray actor per rank; local: this process is the only rank. Under torchrun or the "
                        "deepspeed launcher each process is a rank (from the environment) whatever this says",
                        choices=["ray", "local"])
    ray_address: str | None = arg(None, "Ray cluster to attach to ('auto': the running one); none: $RAY_ADDRESS "
                                  "(set by ray job submit), else start a local one")
    num_nodes: int = arg(1, "nodes to place ranks on (--launcher ray)", at_least=1)
    num_gpus_per_node: int = arg(1, "ranks per node; on a CPU-only cluster, CPU workers per node (--launcher ray)",
                                 at_least=1)
    num_cpus_per_worker: int | None = arg(None, "CPUs reserved for each rank (--launcher ray)", at_least=1,
                                          special={None: "the node's CPUs / --num_gpus_per_node"})


def planned_world_size(launch_cfg: LaunchConfig) -> int:
    """The ranks the run will have: torchrun's WORLD_SIZE, 1 with --launcher local, else the Ray layout."""
    if launched_by_environment():
        return int(os.environ.get("WORLD_SIZE", "1"))
    return 1 if launch_cfg.launcher == "local" else launch_cfg.num_nodes * launch_cfg.num_gpus_per_node


def check_batch_split(train: TrainConfig, launch_cfg: LaunchConfig) -> None:
    """Fixed micro-batches (no --use_dynamic_batch) make a step of the same whole number of them on every
    data-parallel rank (the ranks of a --ring_attn_size context group share theirs)."""
    world = planned_world_size(launch_cfg) // (getattr(train, "ring_attn_size", None) or 1)  # not every command has it
    if not train.use_dynamic_batch and train.train_batch_size % (train.micro_train_batch_size * world):
        raise ConfigError(
            f"--train_batch_size {train.train_batch_size} does not split into micro-batches of "
            f"--micro_train_batch_size {train.micro_train_batch_size} on {world} data-parallel rank(s); make it a "
            f"multiple of {train.micro_train_batch_size * world}, or pass --packing_samples --use_dynamic_batch"
        )


def check_demo_pairing(pretrain: str | None, data: list[str] | None, data_flag: str) -> None:
    """A model and data come together: the demo's data would not tokenize with a user's model, nor the reverse."""
    if (pretrain is None) != (data is None):
        raise ConfigError(
            f"give --pretrain and {data_flag} together, or neither for the built-in demo "
            "(the demo model's tokenizer only knows the demo task's characters)"
        )


def check_consistency(model: ModelConfig, datasets: list[str] | None, train: TrainConfig,
                      launch_cfg: LaunchConfig) -> None:
    """The checks across sections that train_sft, train_dpo and train_rm share."""
    check_batch_split(train, launch_cfg)
    check_demo_pairing(model.pretrain, datasets, "--dataset")
    if model.param_offload and model.zero_stage != 3:
        raise ConfigError("--param_offload needs --zero_stage 3")
    if model.adam_offload and model.zero_stage == 0:
        raise ConfigError("--adam_offload needs --zero_stage >= 1")


def check_inputs(datasets: list[str] | None, models: dict[str, str | None], data_flag: str = "--dataset",
                 prefix_sharing: bool = False) -> None:
    """Before Ray, DeepSpeed or a model load: every model flag's config loads and names a family that packs exactly
    (``models.families``), and every local ``data_flag`` dataset can be read.

    Raises DataError or ModelLoadError, whose messages name the flag.
    """
    from openpack.data.loading import check_dataset_files
    from openpack.models.families import check_model_family
    from openpack.models.loading import load_model_config

    for flag, name in models.items():
        if name is not None:
            check_model_family(load_model_config(name, flag), flag, prefix_sharing)
    if datasets:
        check_dataset_files(datasets, data_flag)
