"""Pick the launcher a command runs its worker with: Ray (a driver and one actor per rank), local, or none.

Under torchrun or the deepspeed launcher every process is already a rank, so
``launch`` just calls the worker. Otherwise ``--launcher local`` runs the
worker in this process and ``--launcher ray`` (the default) makes this
process the Ray driver (``ray_launcher.launch``). Failures a user can act on
end here as one line on stderr and an exit code.
"""

from __future__ import annotations

import logging
import os
import sys


def launched_by_environment() -> bool:
    """torchrun (TORCHELASTIC_RUN_ID) and the deepspeed launcher (CROSS_RANK) start one process per rank.

    Plain RANK/WORLD_SIZE would not do: a ``--launcher local`` run sets them for its own one-rank group.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or "CROSS_RANK" in os.environ


def launch(worker, worker_args: tuple, worker_kwargs: dict, configs: tuple, planner, reference=None) -> int:
    """Run ``worker`` on every rank with the launcher the last config (LaunchConfig) names.

    Under Ray this process is the driver: ``planner(world_size)`` tokenizes the data once and returns
    each rank's plan, handed to rank r as ``plan=``. With ``--launcher local``, torchrun or the deepspeed
    launcher there is no driver: every process is a rank, plans for itself and trains on what it tokenized.
    ``reference`` (train_dpo with --ref_num_nodes) describes a separate reference actor group (Ray only).
    """
    launch_cfg = configs[-1]
    if launched_by_environment():
        return worker(*worker_args, **worker_kwargs)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from openpack.orchestration.ray_launcher import RankDiedError
    from openpack.orchestration.ray_launcher import launch as ray_launch

    try:
        if launch_cfg.launcher == "local":  # the worker plans for itself and keeps what it tokenized
            return worker(*worker_args, **worker_kwargs)
        plans = planner(launch_cfg.num_nodes * launch_cfg.num_gpus_per_node)
        return ray_launch(worker, worker_args, worker_kwargs, [{"plan": plan} for plan in plans],
                          num_nodes=launch_cfg.num_nodes, num_gpus_per_node=launch_cfg.num_gpus_per_node,
                          num_cpus_per_worker=launch_cfg.num_cpus_per_worker, ray_address=launch_cfg.ray_address,
                          reference=reference)
    except RankDiedError as err:
        print(f"openpack: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the Ray launcher has already killed every actor and its local cluster
        print("openpack: interrupted" + ("; all Ray workers were stopped" if launch_cfg.launcher == "ray" else ""),
              file=sys.stderr)
        return 130
