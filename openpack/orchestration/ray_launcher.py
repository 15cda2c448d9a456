"""Run a worker function on Ray: one actor per DeepSpeed rank, reserved in a placement group.

The driver attaches to a running cluster (``--ray_address auto`` or an
address, or ``RAY_ADDRESS`` as ``ray job submit`` sets it) or starts a local
one bound to 127.0.0.1. It reserves
``num_nodes x num_gpus_per_node`` bundles (GPU bundles where the cluster has
GPUs; on a CPU-only machine the same flags start that many CPU workers of
``num_cpus_per_worker`` CPUs each), starts one actor per bundle, makes rank
0's node address and a free port there the rendezvous, and runs the same
worker function every other launcher runs, each with its own keyword
arguments (its share of the driver's plan: sample ids, never tensors). Rank
0's console lines reach the driver through Ray's log forwarding.

A separate reference group (``train_dpo --ref_num_nodes``) is a second
placement group of actors forming their own process group: each holds the
reference model (ZeRO-3-partitioned across the group when the policy uses
ZeRO-3) and scores the packed micro-batches policy ranks send it, returning
one log-prob sum per segment. Policy rank r is served by reference rank
r mod M, and M must divide the policy world size, so every reference rank
receives the same number of forwards (ZeRO-3's gathers are collective).

A worker's exception is re-raised in the driver as itself (so a data error
prints its one-line message); a rank that dies is reported with its node and
the run exits non-zero. Ctrl-C in the driver kills every actor before it
exits, so no worker outlives the command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass
class ReferenceGroupSpec:
    """A reference actor group: ``build(*args)`` runs in each of its actors and returns a segment scorer."""

    build: Callable
    args: tuple
    num_nodes: int
    num_gpus_per_node: int


class _Placed:
    """What the driver asks of every actor before it starts work: where it runs, and a port there."""

    def node(self) -> tuple[str, int]:
        import ray

        return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}", os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        import ray

        from openpack.distributed.process import free_port

        return ray.util.get_node_ip_address(), free_port()


class _Rank(_Placed):
    """One DeepSpeed rank: its environment is set, then the worker function runs in it."""

    def run(self, env: dict, worker: Callable, args: tuple, kwargs: dict):
        os.environ.update(env)
        return worker(*args, **kwargs)


class _Reference(_Placed):
    """One rank of the reference group: builds its scorer once, then scores batches sent to it."""

    def setup(self, env: dict, build: Callable, args: tuple) -> None:
        os.environ.update(env)
        self.scorer = build(*args)

    def segment_sums(self, batch):
        return self.scorer.segment_sums(batch).cpu()


class RemoteReference:
    """The scorer interface (``segment_sums(batch)``) backed by one reference actor."""

    def __init__(self, actor):
        self.actor = actor

    def segment_sums(self, batch):
        import ray

        return ray.get(self.actor.segment_sums.remote(batch.to("cpu")))


class ReferenceGroup:
    """Handed to every policy rank; ``scorer(rank)`` is the reference actor that serves it."""

    def __init__(self, actors: list):
        self.actors = actors

    def scorer(self, rank: int) -> RemoteReference:
        return RemoteReference(self.actors[rank % len(self.actors)])


def connect(ray_address: str | None, cpus_needed: int) -> None:
    """Attach to ``ray_address`` (or RAY_ADDRESS, which ``ray job submit`` sets), else start a local cluster."""
    import ray

    ray_address = ray_address or os.environ.get("RAY_ADDRESS")
    if ray_address:
        # A cluster on loopback (tests, one machine) must be joined from loopback too, or Ray swaps
        # in the machine's interface address and never reaches the head node.
        local = ray_address.split(":")[0] in ("127.0.0.1", "localhost")
        ray.init(address=ray_address, log_to_driver=True, **({"_node_ip_address": "127.0.0.1"} if local else {}))
    else:  # always a new local cluster on loopback (never one left running), sized to the workers asked for
        ray.init(address="local", num_cpus=max(cpus_needed, os.cpu_count() or 1), _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=True)


def default_cpus_per_worker(ranks_per_node: int) -> int:
    """A GPU node's CPUs per GPU; on CPU-only nodes, the smallest node's CPUs shared by its ranks."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    gpu_nodes = [n for n in nodes if n.get("GPU")]
    if gpu_nodes:
        return max(1, min(int(n["CPU"] // n["GPU"]) for n in gpu_nodes))
    return max(1, min(int(n.get("CPU", 1)) for n in nodes) // ranks_per_node)


def launch(worker: Callable, args: tuple, kwargs: dict, rank_kwargs: list[dict], *, num_nodes: int,
           num_gpus_per_node: int,
           num_cpus_per_worker: int | None, ray_address: str | None = None,
           reference: ReferenceGroupSpec | None = None):
    """Run ``worker(*args, **kwargs, **rank_kwargs[rank])`` on every rank; returns rank 0's result."""
    import ray

    world = num_nodes * num_gpus_per_node
    ref_world = reference.num_nodes * reference.num_gpus_per_node if reference else 0
    if ref_world and (ref_world > world or world % ref_world):
        raise ValueError(f"{ref_world} reference ranks must divide the {world} policy ranks")
    owned = not ray.is_initialized()
    if owned:
        connect(ray_address, (world + ref_world) * (num_cpus_per_worker or 1))
    cpus = num_cpus_per_worker or default_cpus_per_worker(num_gpus_per_node + (reference.num_gpus_per_node
                                                                              if reference else 0))
    groups = []
    try:
        if reference:
            ref_actors, ref_nodes, ref_group = _start_group(_Reference, "reference", ref_world, cpus)
            groups.append((ref_actors, ref_group))
            ray.get([a.setup.remote(env, reference.build, reference.args)
                     for a, env in zip(ref_actors, _rank_envs(ref_actors, ref_nodes, cpus))])
            kwargs = {**kwargs, "reference_group": ReferenceGroup(ref_actors)}
        actors, nodes, group = _start_group(_Rank, "rank", world, cpus)
        groups.append((actors, group))
        envs = _rank_envs(actors, nodes, cpus)
        runs = [a.run.remote(envs[r], worker, args, {**kwargs, **rank_kwargs[r]}) for r, a in enumerate(actors)]
        return _wait(runs, nodes)[0]
    finally:  # also on Ctrl-C: no actor outlives the driver
        for actors, group in groups:
            for a in actors:
                ray.kill(a)
            ray.util.remove_placement_group(group)
        if owned:
            ray.shutdown()


def _start_group(cls, name: str, world: int, cpus: int):
    """``world`` actors of ``cls``, one per bundle of a new placement group; prints where each runs."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= world else 0
    group = placement_group([{"CPU": cpus, **({"GPU": 1} if gpus else {})} for _ in range(world)], strategy="PACK")
    ray.get(group.ready())
    remote = ray.remote(cls)
    actors = [
        remote.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank)).remote()
        for rank in range(world)
    ]
    placed = ray.get([a.node.remote() for a in actors])
    nodes = [node for node, _ in placed]
    for rank, (node, pid) in enumerate(placed):
        print(f"ray: {name} {rank} pid {pid} on node {node}", flush=True)
    return actors, nodes, group


def _rank_envs(actors: list, nodes: list[str], cpus: int) -> list[dict]:
    """The torch.distributed environment of each actor: rank 0's node and a free port there are the rendezvous."""
    import ray

    world = len(actors)
    master_addr, master_port = ray.get(actors[0].rendezvous.remote())
    envs = []
    for rank in range(world):
        local_ranks = [r for r in range(world) if nodes[r] == nodes[rank]]
        envs.append({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": master_addr,
                     "MASTER_PORT": str(master_port), "LOCAL_RANK": str(local_ranks.index(rank)),
                     "LOCAL_WORLD_SIZE": str(len(local_ranks)), "OMP_NUM_THREADS": str(cpus)})
    return envs


def _wait(runs, nodes):
    """Results of every rank, failing as soon as one rank fails (the others may hang in a collective)."""
    import ray

    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ray.exceptions.RayActorError):  # a rank lost its reference actor
                raise RankDiedError(f"ray: a reference actor died ({err.cause}); the last checkpoint is intact: "
                                    "rerun with --load_checkpoint to resume") from err
            raise err.cause if err.cause is not None else err
        except ray.exceptions.RayActorError as err:
            rank = runs.index(done[0])
            raise RankDiedError(f"ray: rank {rank} on node {nodes[rank]} died ({type(err).__name__}); "
                                "the last checkpoint is intact: rerun with --load_checkpoint to resume") from err
    return ray.get(runs)


class RankDiedError(RuntimeError):
    """A worker process died (killed, out of memory, node lost)."""
