"""The five training commands as values ``run_training`` runs, what each trains, and the demo stages that chain them.

A demo that starts from another demo's model runs that command first, through ``run_training`` with fixed flags and
a ``--save_path`` in the demo cache (``trainers/demo.py`` names the folder by a digest of the recipe and the code):
the SFT demo model for the DPO, RM and RL demos, the reward-model demo for the PPO demo, and an SFT run on the agent
demo's conversations for ``--demo agent``. The stages sit here rather than beside the demos in ``trainers/``:
running a command (parse, check, lock the save path, launch) is this package's work, and trainers sit below it and
may not import it; nor may one cli module import another.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from openpack.config import dpo, rl, rm, sft
from openpack.config.dpo import DPORunConfig
from openpack.config.rl import PPORunConfig
from openpack.config.rl_checks import check_rl_run
from openpack.config.rm import RMRunConfig
from openpack.config.runner import TrainingCommand, run_training
from openpack.config.schema import ConfigError
from openpack.config.sections import LaunchConfig
from openpack.config.sft import SFTRunConfig
from openpack.orchestration.actor_groups import (dpo_reference_group, engine_group, reward_groups, rl_reference_group,
                                                 rl_teacher_group)
from openpack.orchestration.launch import launch


def train_sft(cfg: SFTRunConfig) -> int:
    """Every rank runs ``run_sft`` on its share of the driver's plan."""
    from openpack.trainers.sft_worker import plan_sft, run_sft

    return launch(run_sft, cfg, {"save_config": cfg.save}, functools.partial(plan_sft, cfg))


def train_dpo(cfg: DPORunConfig) -> int:
    """Every rank runs ``run_dpo``; with --ref_num_nodes the reference is a group of its own."""
    from openpack.trainers.dpo_worker import plan_dpo, run_dpo

    demo_model = demo_start(cfg)
    return launch(run_dpo, cfg, {"demo_model": demo_model, "save_config": cfg.save},
                  functools.partial(plan_dpo, cfg, demo_model=demo_model),
                  reference=dpo_reference_group(cfg, demo_model))


def train_rm(cfg: RMRunConfig) -> int:
    """Every rank runs ``run_rm`` on its share of the driver's plan."""
    from openpack.trainers.rm_worker import plan_rm, run_rm

    demo_model = demo_start(cfg)
    return launch(run_rm, cfg, {"demo_model": demo_model, "save_config": cfg.save},
                  functools.partial(plan_rm, cfg, demo_model=demo_model))


def train_rl(cfg: PPORunConfig) -> int:
    """Every rank runs ``run_ppo``; engines, reward models, the reference and the teacher are actor groups where
    the flags and the launcher place them so (``orchestration/actor_groups.py``)."""
    from openpack.rl.worker import plan_rl, run_ppo

    demo_model = demo_start(cfg)
    cfg = with_demo_reward_model(cfg, demo_model)
    return launch(run_ppo, cfg, {"demo_model": demo_model, "save_config": cfg.save},
                  functools.partial(plan_rl, cfg, demo_model=demo_model), engines=engine_group(cfg, demo_model),
                  rewards=reward_groups(cfg), reference=rl_reference_group(cfg, demo_model),
                  teacher=rl_teacher_group(cfg))


def prepare_rl(cfg: PPORunConfig) -> PPORunConfig:
    """``--demo agent``'s model, prompts and tools first (its SFT stage trained if missing), then every check."""
    return check_rl_run(with_agent_demo(cfg) if cfg.agent.demo else cfg)


# ---------------------------------------------------------------------------------------------- demo stages

def demo_start(cfg) -> Path | None:
    """The model a DPO, RM or RL demo starts from (no --pretrain): the SFT demo model; None for a user's model."""
    return demo_sft_model(cfg.launch, cfg.train.seed) if cfg.model.pretrain is None else None


def demo_sft_model(launch_cfg: LaunchConfig, seed: int) -> Path:
    """The SFT demo model the DPO and RM demos start from: `openpack train_sft`'s demo with their ``--seed``, cached.

    The cache folder is named by a digest of the SFT recipe, the package's code and the library versions
    (``demo.code_key``) and by the seed, so a model trained by other code is never reused.
    """
    from openpack.trainers import demo

    cache = demo.cache_root() / f"demo_sft-{demo.code_key(sft.DEMO_CONFIG)}-seed{seed}"
    with demo.building(cache):
        if not (cache / "model" / "config.json").exists():
            print(f"openpack: training the SFT demo model first (cached in {cache})")
            run_stage(SFT, ["--save_path", str(cache), "--seed", str(seed)], launch_cfg)
    return cache / "model"


def demo_rm_model(launch_cfg: LaunchConfig, seed: int) -> Path:
    """The reward model the PPO demo scores with: `openpack train_rm`'s demo with ``--normalize_reward`` and that
    ``--seed``, cached like the SFT demo model (a folder named by a digest of the recipes and the code)."""
    from openpack.trainers import demo

    cache = demo.cache_root() / f"demo_rm-{demo.code_key(rm.DEMO_CONFIG, sft.DEMO_CONFIG)}-seed{seed}"
    with demo.building(cache):
        if not (cache / "model" / "config.json").exists():
            print(f"openpack: training the reward-model demo first (cached in {cache})")
            run_stage(RM, ["--save_path", str(cache), "--seed", str(seed), "--normalize_reward"], launch_cfg)
    return cache / "model"


def with_demo_reward_model(cfg: PPORunConfig, demo_model: Path | None) -> PPORunConfig:
    """The PPO demo (a demo run with GAE and no reward given) is scored by the reward-model demo's model."""
    rl_cfg = cfg.rl
    if demo_model is None or rl_cfg.advantage_estimator != "gae" or rl_cfg.reward_pretrain or rl_cfg.reward_fn \
            or rl_cfg.remote_rm_url or rl_cfg.teacher_pretrain:  # a teacher without a reward: distillation alone
        return cfg
    return replace(cfg, rl=replace(rl_cfg, reward_pretrain=[str(demo_rm_model(cfg.launch, cfg.train.seed))]))


def with_agent_demo(cfg: PPORunConfig) -> PPORunConfig:
    """``--demo agent``: the demo's SFT model (trained first with ``openpack train_sft`` and cached), prompts,
    held-out prompts and tools file, for the flags the user left unset (``trainers/agent_demo.py``)."""
    from openpack.trainers import agent_demo, demo

    if cfg.model.pretrain or cfg.data.prompt_data or cfg.agent.enabled:
        raise ConfigError("--demo agent brings its own model, prompts and tools: drop --pretrain, --prompt_data, "
                          "--env_file, --agent_func_path and --tools")
    with demo.building(agent_demo.cache_folder(cfg.train.seed)):
        files, sft_argv = agent_demo.prepare(cfg.train.seed)
        if sft_argv is not None:
            print(f"openpack: training the agent demo's SFT model first (cached in "
                  f"{Path(files['model']).parent.parent})")
            run_stage(SFT, sft_argv, cfg.launch)
    return replace(cfg, model=replace(cfg.model, pretrain=files["model"]),
                   data=replace(cfg.data, prompt_data=[files["prompts"]], label_key="answer"),
                   agent=replace(cfg.agent, tools=files["tools"]),
                   evaluation=replace(cfg.evaluation,
                                      eval_prompt_data=cfg.evaluation.eval_prompt_data or files["eval"]))


def run_stage(command: TrainingCommand, argv: list[str], launch_cfg: LaunchConfig) -> None:
    """``command`` with ``argv``, launched as the run that needs it is. A stage that fails or is stopped (130, 143)
    has said why: its exit code becomes the command's, with no traceback."""
    launch_flags = ["--launcher", launch_cfg.launcher] + (["--ray_address", launch_cfg.ray_address]
                                                          if launch_cfg.ray_address else [])
    code = run_training(command, [*argv, *launch_flags])
    if code != 0:
        raise SystemExit(code)


# ---------------------------------------------------------------------------------------------- the commands

SFT = TrainingCommand("train_sft", sft.DESCRIPTION, SFTRunConfig, sft.DEMO_CONFIG, sft.check_sft, train_sft)
DPO = TrainingCommand("train_dpo", dpo.DESCRIPTION, DPORunConfig, dpo.DEMO_CONFIG, dpo.check_dpo, train_dpo,
                      aliases=dpo.ALIASES, epilog=dpo.LOSS_HELP)
RM = TrainingCommand("train_rm", rm.DESCRIPTION, RMRunConfig, rm.DEMO_CONFIG, rm.check_rm, train_rm)
PPO = TrainingCommand("train_ppo", rl.DESCRIPTION, PPORunConfig, rl.PPO_DEMO_CONFIG, prepare_rl, train_rl,
                      data_flag="--prompt_data", flag_demos={"--demo": rl.AGENT_DEMO_CONFIG})
GRPO = replace(PPO, name="train_grpo", run_config=rl.GRPORunConfig, demo_config=rl.DEMO_CONFIG)
