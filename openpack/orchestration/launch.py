"""Pick the launcher a command runs its worker with: Ray (a driver and one actor per rank), local, or none.

Under torchrun or the deepspeed launcher every process is already a rank, so
``launch`` just calls the worker. Otherwise ``--launcher local`` runs the
worker in this process and ``--launcher ray`` (the default) makes this
process the Ray driver (``ray_launcher.launch``). Failures a user can act on
end here as one line on stderr and an exit code: 2 for a ``--ray_address``
with no cluster behind it (checked before the data is planned), 1 for a rank
that died, 130 for Ctrl-C and 143 for SIGTERM (``stopping.py`` says why).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from openpack.orchestration.stopping import Stopped, StopSignals


def launched_by_environment() -> bool:
    """torchrun (TORCHELASTIC_RUN_ID) and the deepspeed launcher (CROSS_RANK) start one process per rank.

    Plain RANK/WORLD_SIZE would not do: a ``--launcher local`` run sets them for its own one-rank group.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or "CROSS_RANK" in os.environ


def launch(worker, cfg, worker_kwargs: dict, planner, reference=None, engines=None, rewards=None,
           teacher=None) -> int:
    """Run ``worker(cfg, **worker_kwargs)`` on every rank with the launcher ``cfg.launch`` names (``cfg``: the
    command's run config, ``config/schema.py``'s ``RunConfig``).

    Under Ray this process is the driver: ``planner(world_size)`` tokenizes the data once and returns
    each rank's plan, handed to rank r as ``plan=``. With ``--launcher local``, torchrun or the deepspeed
    launcher there is no driver: every process is a rank, plans for itself and trains on what it tokenized.
    ``reference`` (train_dpo with --ref_num_nodes) describes a separate reference actor group, ``engines``
    (online RL with vLLM) the rollout engine actors, ``rewards`` (online RL with reward models) one actor group
    per model, ``teacher`` (online RL with --teacher_num_nodes) the distillation teacher's actor (Ray only).
    """
    launch_cfg = cfg.launch
    if launched_by_environment():
        return worker(cfg, **worker_kwargs)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run():
        if launch_cfg.launcher != "ray":  # the worker plans for itself and keeps what it tokenized
            return worker(cfg, **worker_kwargs)
        from openpack.orchestration.ray_launcher import cluster_address
        from openpack.orchestration.ray_launcher import launch as ray_launch

        address = cluster_address(launch_cfg.ray_address)  # before planning, which can take minutes
        plans = planner(launch_cfg.num_nodes * launch_cfg.num_gpus_per_node)
        return ray_launch(worker, (cfg,), worker_kwargs, [{"plan": plan} for plan in plans],
                          num_nodes=launch_cfg.num_nodes, num_gpus_per_node=launch_cfg.num_gpus_per_node,
                          num_cpus_per_worker=launch_cfg.num_cpus_per_worker, ray_address=address,
                          reference=reference, engines=engines, rewards=rewards, teacher=teacher,
                          memory_advice=memory_advice(cfg.sections()))

    code, result = launch_command(run, launch_cfg.launcher)
    return code or result


def launch_command(run, launcher: str) -> tuple[int, object]:
    """``run()`` under the driver's signal handling; (0, its result), or (exit code, None) after one line on stderr.

    The codes: 2 for a ``--ray_address`` with no cluster behind it or a model whose weights vLLM names otherwise, 1 for a rank that died, 130 for Ctrl-C and
    143 for SIGTERM. Shared by every command that runs work locally or on Ray (training, ``openpack score``).
    """
    from openpack.orchestration.ray_launcher import ClusterUnreachable, RankDiedError
    from openpack.rollout.interface import EngineDiedError, EngineStartError
    from openpack.rollout.weight_sync import WeightNamesError

    quiet_console()
    try:
        with StopSignals(defer=False):
            return 0, run()
    except ClusterUnreachable as err:
        print(f"openpack: {err}", file=sys.stderr)
        return 2, None
    except RankDiedError as err:
        print(f"openpack: {err}", file=sys.stderr)
        return 1, None
    except (WeightNamesError, EngineStartError) as err:  # before the first step: nothing trained or to resume
        print(f"openpack: {err}", file=sys.stderr)
        return 2, None
    except EngineDiedError as err:  # raised in a rank between checkpoints, like a dead rank's collectives
        print(f"openpack: {err}; the last checkpoint is intact: rerun with --load_checkpoint to resume",
              file=sys.stderr)
        return 1, None
    except KeyboardInterrupt as err:  # the Ray launcher has already stopped every actor and its local cluster
        stopped = err if isinstance(err, Stopped) else Stopped(signal.SIGINT)
        print(f"openpack: {stopped.describe()}" + ("; all Ray workers were stopped" if launcher == "ray" else ""),
              file=sys.stderr)
        return stopped.exit_code, None


def quiet_console() -> None:
    """The driver's console without known harmless records (``run_log.NOISE``: Ray's token notice among them)
    and, where stdout or stderr is not a terminal, without the colour codes Ray puts around the actor lines it
    replays (a log file read ESC[36m(_Rank pid=...)ESC[0m)."""
    from openpack.distributed.run_log import route_noise

    route_noise()
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def memory_advice(sections: tuple) -> str | None:
    """What to change when a rank is killed for memory: the flag, its value and a smaller one to try.

    Packed dynamic batches are capped by ``--max_tokens_per_gpu``; fixed micro-batches by
    ``--micro_train_batch_size``, and at one sample by ``--max_len`` unless gradient checkpointing is still off.
    """
    options = {k: v for section in sections for k, v in vars(section).items()}
    if "max_tokens_per_gpu" not in options or "max_len" not in options and not options["use_dynamic_batch"]:
        return None
    if options["use_dynamic_batch"]:
        cap = options["max_tokens_per_gpu"]
        if cap is None:  # RL's automatic cap: its value is in the run's first log lines
            return "pass --max_tokens_per_gpu below the automatic cap the run logged at start (try half of it)"
        return f"lower --max_tokens_per_gpu {cap} (try {cap // 2})"
    if options["micro_train_batch_size"] > 1:
        size = options["micro_train_batch_size"]
        return f"lower --micro_train_batch_size {size} (try {size // 2})"
    if not options.get("gradient_checkpointing", True):
        return "add --gradient_checkpointing"
    return f"lower --max_len {options['max_len']} (try {options['max_len'] // 2})"
