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

import os
from typing import Callable


def _rank_actor_class():
    import ray

    @ray.remote
    class RankActor:
        """One DeepSpeed rank: its environment is set, then the worker function runs in it."""

        def rendezvous(self) -> tuple[str, int]:
            from openpack.distributed.process import free_port

            return ray.util.get_node_ip_address(), free_port()

        def node(self) -> tuple[str, int]:
            return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}", os.getpid()

        def run(self, env: dict, worker: Callable, args: tuple, kwargs: dict):
            os.environ.update(env)
            return worker(*args, **kwargs)

    return RankActor


def connect(ray_address: str | None, cpus_needed: int) -> None:
    import ray

    if ray.is_initialized():
        return
    if ray_address:
        # A cluster on loopback (tests, one machine) must be joined from loopback too, or Ray swaps
        # in the machine's interface address and never reaches the head node.
        local = ray_address.split(":")[0] in ("127.0.0.1", "localhost")
        ray.init(address=ray_address, log_to_driver=True, **({"_node_ip_address": "127.0.0.1"} if local else {}))
    else:  # always a new local cluster on loopback (never one left running), sized to the workers asked for
        ray.init(address="local", num_cpus=max(cpus_needed, os.cpu_count() or 1), _node_ip_address="127.0.0.1",
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
    placed = ray.get([a.node.remote() for a in actors])
    nodes = [node for node, _ in placed]
    for rank, (node, pid) in enumerate(placed):
        print(f"ray: rank {rank} pid {pid} on node {node}", flush=True)
    master_addr, master_port = ray.get(actors[0].rendezvous.remote())
    print(f"ray: {world} ranks on nodes {sorted(set(nodes))}, rendezvous {master_addr}:{master_port}", flush=True)
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
    """Results of every rank, failing as soon as one rank fails (the others may hang in a collective)."""
    import ray

    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as err:
            raise err.cause if err.cause is not None else err
        except ray.exceptions.RayActorError as err:
            rank = runs.index(done[0])
            raise RankDiedError(f"ray: rank {rank} on node {nodes[rank]} died ({type(err).__name__}); "
                                "the last checkpoint is intact: rerun with --load_checkpoint to resume") from err
    return ray.get(runs)


class RankDiedError(RuntimeError):
    """A worker process died (killed, out of memory, node lost)."""
