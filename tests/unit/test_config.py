"""Config system: defaults < --config YAML < flags, checked keys and types, round trip."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from openpack.config.schema import (
    ConfigError, arg, build_parser, config_to_dict, parse_config, save_config, special_values,
)


@dataclass
class ModelArgs:
    """Which model to train."""

    pretrain: str = arg("tiny-llama", "HF model name or local path")
    max_len: int = arg(2048, "max tokens per sample")
    lora_rank: int | None = arg(None, "LoRA rank; None trains every weight")
    target_modules: list[str] = arg(["q_proj", "v_proj"], "modules LoRA adapts")

    def validate(self) -> None:
        if self.max_len < 1:
            raise ConfigError(f"--max_len must be >= 1, got {self.max_len}")


@dataclass
class TrainArgs:
    beta: float = arg(0.1, "DPO temperature")
    learning_rate: float = arg(5e-7, "peak learning rate")
    loss_type: str = arg("sigmoid", "preference loss", choices=["sigmoid", "ipo", "hinge"])
    packing_samples: bool = arg(True, "pack samples into rows")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward")
    eval_steps: list[int] = arg([100], "steps at which to evaluate")


CLASSES = (ModelArgs, TrainArgs)
ALIASES = {"--ipo": ("loss_type", "ipo")}


def parse(argv: list[str]) -> tuple:
    return parse_config(argv, "openpack train_dpo", "DPO training", *CLASSES, aliases=ALIASES)


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_defaults():
    model, train = parse([])
    assert (model, train) == (ModelArgs(), TrainArgs())
    assert model.target_modules is not ModelArgs().target_modules  # default_factory, not shared


def test_yaml_overrides_defaults(tmp_path):
    # `1e-5` without a dot is a string in PyYAML (YAML 1.1); the config loader reads a float.
    path = write(tmp_path, "beta: 1\nlearning_rate: 1e-5\nmax_len: 512\nlora_rank: null\n")
    model, train = parse(["--config", path])
    assert train.beta == 1.0 and isinstance(train.beta, float)  # int widens to a float field
    assert train.learning_rate == 1e-5
    assert model.max_len == 512 and model.lora_rank is None
    assert train.loss_type == "sigmoid"  # untouched keys keep their defaults


def test_flags_override_yaml(tmp_path):
    path = write(tmp_path, "beta: 0.5\nmax_len: 512\n")
    model, train = parse(["--config", path, "--beta", "0.25"])
    assert train.beta == 0.25 and model.max_len == 512
    # order does not matter: a flag beats the file even when it comes first
    model, train = parse(["--max_len", "64", "--config", path])
    assert model.max_len == 64 and train.beta == 0.5


def test_unknown_yaml_key_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, "betta: 0.2\n")
    with pytest.raises(ConfigError) as err:
        parse(["--config", path])
    msg = str(err.value)
    assert path in msg and "'betta'" in msg and "did you mean 'beta'?" in msg


def test_yaml_type_error_names_file_and_key(tmp_path):
    path = write(tmp_path, 'max_len: "3"\n')
    with pytest.raises(ConfigError, match="max_len") as err:
        parse(["--config", path])
    assert path in str(err.value) and "expected int" in str(err.value)
    with pytest.raises(ConfigError, match="not one of sigmoid, ipo, hinge"):
        parse(["--config", write(tmp_path, "loss_type: dpo\n")])
    with pytest.raises(ConfigError, match="expected a list of int"):
        parse(["--config", write(tmp_path, "eval_steps: 5\n")])


def test_bool_flags():
    _, train = parse(["--no_packing_samples", "--gradient_checkpointing"])
    assert train.packing_samples is False and train.gradient_checkpointing is True
    help_text = build_parser("p", "d", *CLASSES).format_help()
    assert "--packing_samples | --no_packing_samples" in help_text


def test_optional_none():
    assert parse(["--lora_rank", "8"])[0].lora_rank == 8
    assert parse(["--lora_rank", "None"])[0].lora_rank is None
    assert parse(["--lora_rank", "null"])[0].lora_rank is None


def test_list_nargs():
    model, train = parse(["--target_modules", "q_proj", "k_proj", "o_proj", "--eval_steps", "10", "20"])
    assert model.target_modules == ["q_proj", "k_proj", "o_proj"]
    assert train.eval_steps == [10, 20]


def test_alias_flag():
    assert parse(["--ipo"])[1].loss_type == "ipo"
    help_text = build_parser("p", "d", *CLASSES, aliases=ALIASES).format_help()
    assert "alias of --loss_type ipo" in help_text
    with pytest.raises(ValueError, match="unknown field 'loss'"):
        build_parser("p", "d", *CLASSES, aliases={"--ipo": ("loss", "ipo")})


def test_cli_errors_exit(capsys):
    for argv in (["--bogus", "1"], ["--bet", "0.3"], ["--loss_type", "dpo"], ["--max_len", "x"]):
        with pytest.raises(SystemExit):
            parse(argv)
    assert "invalid int value: 'x'" in capsys.readouterr().err


def test_duplicate_field_names_rejected():
    @dataclass
    class Other:
        beta: float = arg(0.2, "a second beta")

    with pytest.raises(ValueError, match="'beta' of Other clashes with TrainArgs"):
        build_parser("p", "d", TrainArgs, Other)


def test_save_load_round_trip(tmp_path):
    # "1e-5" as a str must come back as a str: the saver quotes it.
    model = ModelArgs(pretrain="1e-5", max_len=77, lora_rank=4, target_modules=["a"])
    train = TrainArgs(beta=0.3, learning_rate=3e-6, loss_type="hinge", packing_samples=False, eval_steps=[1, 2])
    path = tmp_path / "out" / "config.yaml"
    save_config(path, model, train)
    assert os.listdir(path.parent) == ["config.yaml"]  # no temporary file left behind
    assert parse(["--config", str(path)]) == (model, train)
    assert config_to_dict(model, train)["eval_steps"] == [1, 2]


def test_validate_is_called(tmp_path):
    with pytest.raises(ConfigError, match="--max_len must be >= 1, got 0"):
        parse(["--max_len", "0"])
    with pytest.raises(ConfigError, match="--max_len must be >= 1, got 0"):
        parse(["--config", write(tmp_path, "max_len: 0\n")])


@dataclass
class RangedArgs:
    max_steps: int | None = arg(None, "stop after N steps", at_least=1, special={None: "every epoch"})
    learning_rate: float = arg(1e-5, "peak learning rate", above=0)
    betas: list[float] = arg([0.9, 0.95], "AdamW betas", at_least=0, below=1)
    max_norm: float = arg(1.0, "clipping norm", at_least=0, special={0.0: "no clipping"})


def test_every_number_is_range_checked_from_flags_and_yaml(tmp_path):
    """Flags and YAML alike; the message names the flag, the range, the value and what the flag means."""
    def parse_ranged(argv, cls):
        return parse_config(argv, "p", "d", cls)

    with pytest.raises(ConfigError, match=r"--max_steps must be >= 1, got 0 \(stop after N steps; none means every epoch\)"):
        parse_ranged(["--max_steps", "0"], RangedArgs)
    with pytest.raises(ConfigError, match="--learning_rate must be > 0, got -1"):
        parse_ranged(["--config", write(tmp_path, "learning_rate: -1\n")], RangedArgs)
    with pytest.raises(ConfigError, match="--betas must be >= 0 and < 1, got 0.9 1.0"):
        parse_ranged(["--betas", "0.9", "1.0"], RangedArgs)
    (ranged,) = parse_ranged(["--max_steps", "None", "--max_norm", "0"], RangedArgs)
    assert ranged.max_steps is None and ranged.max_norm == 0.0


def test_help_and_log_say_what_special_values_mean():
    help_text = " ".join(build_parser("p", "d", RangedArgs).format_help().split())
    assert "stop after N steps (>= 1; none: every epoch; default: none)" in help_text
    assert "clipping norm (>= 0; 0.0: no clipping; default: 1.0)" in help_text
    assert special_values(RangedArgs(max_norm=0.0)) == ["--max_steps none: every epoch", "--max_norm 0.0: no clipping"]
    assert special_values(RangedArgs(max_steps=5)) == []


def test_a_range_on_a_text_field_is_a_programming_error():
    @dataclass
    class Bad:
        name: str = arg("x", "a name", at_least=1)

    with pytest.raises(TypeError, match="needs an int or float field"):
        build_parser("p", "d", Bad)
