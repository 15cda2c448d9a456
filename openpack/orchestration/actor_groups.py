"""The actor groups a run asks the Ray launcher for beside its ranks: vLLM engines, a group per reward model, a
reference and a distillation teacher (online RL), a reference group (train_dpo), and the reward actors ``openpack
score`` scores on.

Each function reads the sections of a run config it needs (``cfg.rollout``, ``cfg.rl``...; orchestration sits
under the config package and never imports it) and returns the spec ``ray_launcher.launch`` starts, or None where
there is no such group: with --launcher local, torchrun or the deepspeed launcher there is no Ray driver to place
one, and rank 0 (or every rank) builds the same models in its own process instead.
"""

from __future__ import annotations

from openpack.orchestration.launch import launched_by_environment
from openpack.orchestration.ray_launcher import (EngineGroupSpec, ReferenceGroupSpec, ScorerGroupSpec,
                                                 cluster_address, score_on_ray)


def is_ray_driver(launch_cfg) -> bool:
    """Whether this process places the ranks as Ray actors, and so can place other groups beside them."""
    return launch_cfg.launcher == "ray" and not launched_by_environment()


def engine_group(cfg, demo_model) -> EngineGroupSpec | None:
    """vLLM engines as Ray actors when the driver is a Ray driver; otherwise rank 0 starts them in-process."""
    from openpack.rl.generation import vllm_options
    from openpack.rl.worker import resolved_backend

    model_cfg, rollout_cfg = cfg.model, cfg.rollout
    if resolved_backend(rollout_cfg) != "vllm" or not is_ray_driver(cfg.launch):
        return None
    options = {"seed": cfg.train.seed, **vllm_options(rollout_cfg, model_cfg.bf16, cfg.output.save_path)}
    return EngineGroupSpec(model_cfg.pretrain or str(demo_model), rollout_cfg.vllm_num_engines,
                           rollout_cfg.vllm_tensor_parallel_size, options, colocate=rollout_cfg.colocate_all_models,
                           in_flight=rollout_cfg.partial_rollout)


def reward_groups(cfg) -> list[ScorerGroupSpec] | None:
    """One actor group per --reward_pretrain model when the driver is a Ray driver, unless a colocation flag keeps
    the reward models in rank 0."""
    rollout_cfg, rl_cfg = cfg.rollout, cfg.rl
    if not rl_cfg.reward_pretrain or not is_ray_driver(cfg.launch) or rollout_cfg.colocate_critic_reward or \
            rollout_cfg.colocate_all_models:
        return None
    from openpack.models.memory import ROW_CAP

    cap = cfg.train.max_tokens_per_gpu or ROW_CAP  # no gradients in a reward actor: no activations kept
    return [ScorerGroupSpec(build_reward_scorer, (path, cap, cfg.model.bf16), path) for path in rl_cfg.reward_pretrain]


def rl_reference_group(cfg, demo_model) -> ReferenceGroupSpec | None:
    """--ref_num_nodes 1: one reference actor (a process group of its own) when a KL needs the reference and the
    driver is a Ray driver. One, not a group: every policy rank asks it for its own share, and a ZeRO-3 group
    would need the same number of forwards from each of its ranks."""
    if not cfg.rollout.ref_num_nodes or not cfg.rl.init_kl_coef or not is_ray_driver(cfg.launch):
        return None
    from openpack.rl.worker import build_rl_reference

    return ReferenceGroupSpec(build_rl_reference, (cfg, cfg.model.pretrain or str(demo_model)), 1, 1)


def rl_teacher_group(cfg) -> ReferenceGroupSpec | None:
    """--teacher_num_nodes 1: the distillation teacher in one actor of its own, placed as the reference is (the
    checks refused this without --teacher_pretrain or a Ray driver)."""
    if not cfg.rollout.teacher_num_nodes or not cfg.rl.teacher_pretrain or not is_ray_driver(cfg.launch):
        return None
    from openpack.rl.worker import build_rl_teacher

    return ReferenceGroupSpec(build_rl_teacher, (cfg,), 1, 1)


def dpo_reference_group(cfg, demo_model) -> ReferenceGroupSpec | None:
    """--ref_num_nodes N: train_dpo's reference in a group of its own, N x --ref_num_gpus_per_node actors, each
    serving an equal share of the policy ranks (the checks refused this without a Ray driver)."""
    dpo_cfg = cfg.dpo
    if not dpo_cfg.ref_num_nodes:
        return None
    from openpack.trainers.dpo_worker import build_reference

    return ReferenceGroupSpec(build_reference, (cfg, demo_model), dpo_cfg.ref_num_nodes,
                              dpo_cfg.ref_num_gpus_per_node)


def build_reward_scorer(path: str, max_tokens: int, bf16: bool, value_head_prefix: str | None = None):
    """A saved reward model on this process's device, as a reward actor builds it (module level, for Ray)."""
    import torch

    from openpack.models.reward import HEAD, RewardScorer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return RewardScorer(path, device, max_tokens, bf16, value_head_prefix or HEAD)


def score_sequences(scorer_args: tuple, sequences: list[list[int]], launch_cfg):
    """``openpack score``'s rewards, one per sequence: ``build_reward_scorer(*scorer_args)`` in this process
    (--launcher local), or on a group of --reward_num_nodes x --reward_num_gpus_per_node reward actors."""
    if launch_cfg.launcher == "local":
        return build_reward_scorer(*scorer_args).score(sequences)
    return score_on_ray(build_reward_scorer, scorer_args, sequences, num_nodes=launch_cfg.reward_num_nodes,
                        num_gpus_per_node=launch_cfg.reward_num_gpus_per_node,
                        num_cpus_per_worker=launch_cfg.num_cpus_per_worker,
                        ray_address=cluster_address(launch_cfg.ray_address))
