"""Run a worker function on Ray: one actor per DeepSpeed rank, reserved in a placement group.

The driver attaches to a running cluster (``--ray_address auto`` or an
address) or starts a local one bound to 127.0.0.1. It reserves
``num_nodes x num_gpus_per_node`` bundles (GPU bundles where the cluster has
GPUs; on a CPU-only machine the same flags start that many CPU workers of
``num_cpus_per_worker`` CPUs each), starts one actor per bundle, makes rank
0's node address and a free port there the rendezvous, and runs the same
worker function every other launcher runs. Workers load their own data; only
configs travel through Ray. Rank 0's console lines reach the driver through
Ray's log forwarding.

A worker's exception is re-raised in the driver as itself (so a data error
prints its one-line message); a rank that dies is reported with its node and
the run exits non-zero.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

logger = logging.getLogger("openpack")


def _rank_actor_class():
    import ray

    @ray.remote
    class RankActor:
        """One DeepSpeed rank: its environment is set, then the worker function runs in it."""

        def rendezvous(self) -> tuple[str, int]:
            from openpack.distributed.process import free_port

            return ray.util.get_node_ip_address(), free_port()

        def node(self) -> str:
            return ray.util.get_node_ip_address()

        def run(self, env: dict, worker: Callable, args: tuple, kwargs: dict):
            os.environ.update(env)
            return worker(*args, **kwargs)

    return RankActor


def connect(ray_address: str | None, cpus_needed: int) -> None:
    import ray

    if ray.is_initialized():
        return
    if ray_address:
        ray.init(address=ray_address, log_to_driver=True)
    else:  # a local cluster on loopback, sized to the workers asked for
        ray.init(num_cpus=max(cpus_needed, os.cpu_count() or 1), _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=True)


def launch(worker: Callable, args: tuple, kwargs: dict, *, num_nodes: int, num_gpus_per_node: int,
           num_cpus_per_worker: int, ray_address: str | None = None):
    """Run ``worker(*args, **kwargs)`` on every rank; returns rank 0's result."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = num_nodes * num_gpus_per_node
    connect(ray_address, world * num_cpus_per_worker)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= world else 0
    bundles = [{"CPU": num_cpus_per_worker, **({"GPU": 1} if gpus else {})} for _ in range(world)]
    group = placement_group(bundles, strategy="PACK")
    ray.get(group.ready())
    actor = _rank_actor_class()
    actors = [
        actor.options(num_cpus=num_cpus_per_worker, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank)).remote()
        for rank in range(world)
    ]
    nodes = ray.get([a.node.remote() for a in actors])
    master_addr, master_port = ray.get(actors[0].rendezvous.remote())
    logger.info("ray: %d ranks on nodes %s, rendezvous %s:%d", world, sorted(set(nodes)), master_addr, master_port)
    runs = []
    for rank, a in enumerate(actors):
        local_ranks = [r for r in range(world) if nodes[r] == nodes[rank]]
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
               "LOCAL_RANK": str(local_ranks.index(rank)), "LOCAL_WORLD_SIZE": str(len(local_ranks)),
               "OMP_NUM_THREADS": str(num_cpus_per_worker)}
        runs.append(a.run.remote(env, worker, args, kwargs))
    try:
        return _wait(runs, nodes)[0]
    finally:
        for a in actors:
            ray.kill(a)
        ray.util.remove_placement_group(group)


def _wait(runs, nodes):
    import ray

    try:
        return ray.get(runs)
    except ray.exceptions.RayTaskError as err:
        raise err.cause if err.cause is not None else err
    except ray.exceptions.RayActorError as err:
        rank = next((r for r, ref in enumerate(runs) if _failed(ref)), None)
        where = f"rank {rank} on node {nodes[rank]}" if rank is not None else "a rank"
        raise RuntimeError(f"ray: {where} died ({err.__class__.__name__}); the last checkpoint is intact, "
                           "resume with --load_checkpoint") from err


def _failed(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # still running (GetTimeoutError) or failed otherwise: not the dead rank
        return False
    return False
