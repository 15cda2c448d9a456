"""``openpack train_sft``: supervised fine-tuning with packed, dynamically batched micro-batches.

With no ``--pretrain`` and no ``--dataset`` it runs the built-in demo: a
tiny model learns 2-digit addition from scratch on CPU in a few minutes and
reports held-out exact-match accuracy before and after training.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from openpack.config.schema import ConfigError, RunConfig, arg, special_values
from openpack.models.attention import BACKENDS
from openpack.orchestration.launch import launch, launched_by_environment


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


@dataclass
class DataConfig(DatasetConfig):
    input_key: str = arg("prompt", "key of the prompt in each row (else TRL's prompt/completion keys are read)")
    output_key: str = arg("response", "key of the response in each row, the only part trained on")
    apply_chat_template: bool = arg(False, "text prompt/response become a user and an assistant turn of the tokenizer's "
                                    "chat template (lists of messages always do)")
    messages_key: str = arg("messages", "key of a whole conversation (a list of {role, content} messages); a row "
                            "with it is a conversation, whatever else it holds")
    conversation_loss: str = arg("assistant", "tokens of a conversation (--messages_key) trained on: the assistant "
                                 "turns (TRL's assistant_only_loss), or all of them", choices=["assistant", "all"])
    input_template: str | None = arg(None, "text prompts become this with {} replaced by the prompt, e.g. "
                                     "$'User: {}\\nAssistant: ' (OpenRLHF's flag)")

    def validate(self):
        check_template_flags(self.input_template, self.apply_chat_template)


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
    seed: int = arg(42, "seed for data order and initialisation", at_least=0)

    def validate(self):
        if self.use_dynamic_batch and not self.packing_samples:
            raise ConfigError("--use_dynamic_batch needs --packing_samples (dynamic micro-batches are packed rows)")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"--adam_betas takes two numbers, got {self.adam_betas}")


FUSED_LOSS_HELP = ("compute the LM head, the loss and their gradients in one pass, each chunk's logits once instead "
                   "of twice: 3 vocabulary-sized matmuls per token instead of 4, same numbers (docs/benchmarks.md)")


@dataclass
class SFTTrainConfig(TrainConfig):
    fused_loss: bool = arg(False, FUSED_LOSS_HELP)


@dataclass
class OutputConfig:
    save_path: str = arg("./runs/sft", "folder of one run: config.yaml, metrics.jsonl, loss.png, the final model "
                         "(a new run into another run's folder is refused; see --load_checkpoint, --overwrite)")
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


@dataclass
class SFTRunConfig(RunConfig):
    """Everything one ``openpack train_sft`` run is told, by section; what ``run_sft`` receives."""

    model: ModelConfig
    data: DataConfig
    train: SFTTrainConfig
    output: OutputConfig
    launch: LaunchConfig


CONFIGS = SFTRunConfig.section_classes()  # the flag groups, in the order config.yaml lists them


def planned_world_size(launch_cfg: LaunchConfig) -> int:
    """The ranks the run will have: torchrun's WORLD_SIZE, 1 with --launcher local, else the Ray layout."""
    if launched_by_environment():
        return int(os.environ.get("WORLD_SIZE", "1"))
    return 1 if launch_cfg.launcher == "local" else launch_cfg.num_nodes * launch_cfg.num_gpus_per_node


def check_consistency(model: ModelConfig, data: DataConfig, train: TrainConfig, launch_cfg: LaunchConfig) -> None:
    """Checks that span several config groups."""
    world = planned_world_size(launch_cfg)
    if not train.use_dynamic_batch and train.train_batch_size % (train.micro_train_batch_size * world):
        raise ConfigError(
            f"--train_batch_size {train.train_batch_size} does not split into micro-batches of "
            f"--micro_train_batch_size {train.micro_train_batch_size} on {world} rank(s); make it a multiple of "
            f"{train.micro_train_batch_size * world}, or pass --packing_samples --use_dynamic_batch"
        )
    if (model.pretrain is None) != (data.dataset is None):
        raise ConfigError(
            "give --pretrain and --dataset together, or neither for the built-in demo "
            "(the demo model's tokenizer only knows the demo task's characters)"
        )
    if train.use_dynamic_batch and data.max_len > train.max_tokens_per_gpu:
        raise ConfigError(
            f"--max_len {data.max_len} exceeds --max_tokens_per_gpu {train.max_tokens_per_gpu}: "
            "a sample could not fit a row; lower --max_len or raise --max_tokens_per_gpu"
        )
    if model.param_offload and model.zero_stage != 3:
        raise ConfigError("--param_offload needs --zero_stage 3")
    if model.adam_offload and model.zero_stage == 0:
        raise ConfigError("--adam_offload needs --zero_stage >= 1")


DEMO_CONFIG = Path(__file__).resolve().parent.parent / "data" / "demo_configs" / "sft.yaml"


def with_demo_defaults(argv: list[str], command: str, demo_config: Path,
                       data_flag: str = "--dataset") -> tuple[list[str], str | None]:
    """No --pretrain, ``data_flag`` or --config: the built-in demo, its defaults from a YAML shown to the user.

    Returns the argv to parse and the line announcing the demo (printed once the flags are known good).
    """
    if any(a.split("=")[0] in ("--pretrain", data_flag, "--config", "-h", "--help") for a in argv):
        return argv, None
    notice = (f"openpack {command}: no --pretrain/{data_flag}, running the built-in demo with defaults from "
              f"{demo_config}")
    return ["--config", str(demo_config), *argv], notice


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


def announce(command: str, cfg: RunConfig, demo_notice: str | None) -> None:
    """What is about to run: the demo notice, and every flag whose value has a meaning of its own."""
    if demo_notice:
        print(demo_notice)
    special = special_values(*cfg.sections())
    if special:
        print(f"openpack {command}: " + "; ".join(special))


def demo_sft_model(launch_cfg: LaunchConfig, seed: int) -> Path:
    """The SFT demo model the DPO and RM demos start from: `openpack train_sft`'s demo with their ``--seed``, cached.

    The cache folder is named by a digest of the SFT recipe, the package's code and the library versions
    (``demo.code_key``) and by the seed, so a model trained by other code is never reused.
    """
    from openpack.trainers import demo

    cache = demo.cache_root() / f"demo_sft-{demo.code_key(DEMO_CONFIG)}-seed{seed}"
    if not (cache / "model" / "config.json").exists():
        print(f"openpack: training the SFT demo model first (cached in {cache})")
        launch_flags = ["--launcher", launch_cfg.launcher] + (["--ray_address", launch_cfg.ray_address]
                                                              if launch_cfg.ray_address else [])
        code = main(["--save_path", str(cache), "--seed", str(seed), *launch_flags])
        if code != 0:  # the stage said why (or was stopped: 130, 143); its exit code is the command's, no traceback
            raise SystemExit(code)
    return cache / "model"


def main(argv: list[str] | None = None) -> int:
    from openpack.data.loading import DataError
    from openpack.models.loading import ModelLoadError

    argv, demo_notice = with_demo_defaults(sys.argv[1:] if argv is None else list(argv), "train_sft", DEMO_CONFIG)
    try:
        cfg = SFTRunConfig.parse(argv, "openpack train_sft", __doc__.split("\n\n")[0])
        check_consistency(cfg.model, cfg.data, cfg.train, cfg.launch)
        check_inputs(cfg.data.dataset, {"--pretrain": cfg.model.pretrain})
    except (ConfigError, DataError, ModelLoadError) as err:
        print(f"openpack train_sft: {err}", file=sys.stderr)
        return 2
    announce("train_sft", cfg, demo_notice)
    from openpack.distributed.save_path import CheckpointError, own_save_path
    from openpack.trainers.sft_worker import plan_sft, run_sft

    try:
        with own_save_path(cfg.output, launched_by_environment()):  # lock; refuse a taken --save_path
            return launch(run_sft, cfg, {"save_config": cfg.save}, functools.partial(plan_sft, cfg))
    except (DataError, ModelLoadError, CheckpointError) as err:
        print(f"openpack train_sft: {err}", file=sys.stderr)
        return 2
