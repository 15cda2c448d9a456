"""Run a worker function on Ray: one actor per DeepSpeed rank, reserved in a placement group.

The driver attaches to a running cluster (``--ray_address auto`` or an
address, or ``RAY_ADDRESS`` as ``ray job submit`` sets it) or starts a local
one bound to 127.0.0.1. It reserves
``num_nodes x num_gpus_per_node`` bundles (GPU bundles where the cluster has
GPUs; on a CPU-only machine the same flags start that many CPU workers of
``num_cpus_per_worker`` CPUs each), starts one actor per bundle, makes rank
0's node address and a free port there the rendezvous, and runs the same
worker function every other launcher runs, each with its own keyword
arguments (its share of the driver's plan: sample ids, never tensors).

A separate reference group (``train_dpo --ref_num_nodes``) is a second
placement group of actors forming their own process group: each holds the
reference model (ZeRO-3-partitioned across the group when the policy uses
ZeRO-3) and scores the packed micro-batches policy ranks send it, returning
one log-prob sum per segment. Policy rank r is served by reference rank
r mod M, and M must divide the policy world size, so every reference rank
receives the same number of forwards (ZeRO-3's gathers are collective).
Online RL's distillation teacher (``--teacher_num_nodes 1``) is placed the
same way, as one actor of a group of its own.

The driver's loop waits on the ranks 0.5 s at a time. Between waits it
shows rank 0's console (rank 0's tracker sends its steps and messages to a
small inbox actor; the driver replays them with ``tracking.ConsoleRelay``,
a live bar on a terminal) and acts on Ctrl-C or SIGTERM (``stopping.py``:
never inside a Ray call). However the run ends, the actors are killed, the
placement groups removed and a local cluster shut down; a watchdog process
(``watchdog.py``) kills what a local cluster left, even after a SIGKILL.

A worker's exception is re-raised in the driver as itself (so a data error
prints its one-line message). A rank that dies is named with its node and
how it died: lost with its node, killed by Ray's memory monitor, by the
kernel's OOM killer (its counter, read on the driver's node), or else
"killed by the OS (SIGKILL), probably out of memory", since Ray cannot tell
a SIGKILL from a crash ("connection error ... End of file" for both) and the
OOM killer is what sends it in practice; the memory cases name the flag to
lower with its value. Ray's memory monitor kills a worker when the node's
memory passes ``RAY_memory_usage_threshold`` (0.95), whoever holds it; a call on
that actor then raises ``OutOfMemoryError`` (not an actor error), in the driver
or inside a rank (its reference actor, an engine): either way one line names
the actor, the node's memory figures from Ray's report and the fixes.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Callable

from openpack.orchestration.stopping import StopSignals
from openpack.orchestration.watchdog import start_watchdog, stop_watchdog

POLL_S = 0.5  # longest wait inside a Ray call; also how often rank 0's console reaches the driver
DEATH_GRACE_S = 5.0  # after a rank's error, how long to wait for a death that caused it
ENGINE_SHARE = 0.2  # of a bundle's GPU (or CPUs) a colocated engine claims, the rank the rest (as OpenRLHF)


@dataclass
class ReferenceGroupSpec:
    """A reference actor group: ``build(*args)`` runs in each of its actors and returns a segment scorer."""

    build: Callable
    args: tuple
    num_nodes: int
    num_gpus_per_node: int


@dataclass
class EngineGroupSpec:
    """Rollout engines (online RL): ``num_engines`` vLLM actors serving ``model_path``, handed to every rank as an
    ``EngineGroup``. On GPUs each takes ``tensor_parallel_size`` GPUs; on CPUs one CPU each."""

    model_path: str
    num_engines: int
    tensor_parallel_size: int
    options: dict
    colocate: bool = False  # --colocate_all_models: engine i shares rank i's bundle (ENGINE_SHARE of it)
    in_flight: bool = False  # --partial_rollout: weights land while the engines generate (``EngineGroup``)


@dataclass
class ScorerGroupSpec:
    """A reward model's actor group (online RL, ``--reward_pretrain``): ``num_actors`` actors, each running
    ``build(*args)`` once, handed to every rank as a ``ScorerGroup`` named ``name`` (the model's folder)."""

    build: Callable
    args: tuple
    name: str
    num_actors: int = 1


class RankDiedError(RuntimeError):
    """A worker process died (killed, out of memory, node lost)."""


class ScorerDiedError(RankDiedError):
    """A scorer actor (a reward model) died."""


class ClusterUnreachable(RuntimeError):
    """``--ray_address`` (or ``$RAY_ADDRESS``) names no Ray cluster that answers."""


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

    def run(self, env: dict, worker: Callable, args: tuple, kwargs: dict, inbox=None):
        from openpack.trainers import tracking

        os.environ.update(env)
        if inbox is None:
            return worker(*args, **kwargs)
        outbox = _Outbox(inbox)
        tracking.forward_console(outbox)  # rank 0: the driver shows the console, this actor's stdout is a log file
        try:
            return worker(*args, **kwargs)
        finally:
            tracking.forward_console(None)
            with contextlib.suppress(Exception):  # never hide the worker's own error
                outbox.flush()


class _Inbox:
    """Rank 0's console events, kept until the driver's next look."""

    def __init__(self):
        self.events: list[tuple] = []

    def put(self, event: tuple) -> None:
        self.events.append(event)

    def take(self) -> list[tuple]:
        events, self.events = self.events, []
        return events


class _Outbox:
    """Rank 0's end: one call on the inbox per event (a sync actor runs one caller's calls in order), unwaited."""

    def __init__(self, inbox):
        self.inbox, self.last = inbox, None

    def __call__(self, event: tuple) -> None:
        self.last = self.inbox.put.remote(event)

    def flush(self) -> None:
        """Wait until every event is in the inbox, so the driver sees them all once the run returns."""
        import ray

        if self.last is not None:
            ray.get(self.last)


class _Reference(_Placed):
    """One rank of the reference group: builds its scorer once, then scores batches sent to it."""

    def setup(self, env: dict, build: Callable, args: tuple) -> None:
        os.environ.update(env)
        self.scorer = build(*args)

    def segment_sums(self, batch):
        return self.scorer.segment_sums(batch).cpu()

    def token_logprobs(self, batch):
        return self.scorer(batch).cpu()


class _Teacher(_Reference):
    """The distillation teacher's actor (online RL): a reference actor by another name, so a death names it."""


class RemoteReference:
    """The scorer interface (``segment_sums(batch)``; called, per-token log-probs) backed by one reference actor."""

    def __init__(self, actor):
        self.actor = actor

    def segment_sums(self, batch):
        import ray

        return ray.get(self.actor.segment_sums.remote(batch.to("cpu")))

    def __call__(self, batch):
        """Per-token log-probs of ``batch`` (online RL), on the batch's device."""
        import ray

        return ray.get(self.actor.token_logprobs.remote(batch.to("cpu"))).to(batch.input_ids.device)


class ReferenceGroup:
    """Handed to every policy rank; ``scorer(rank)`` is the reference actor that serves it."""

    def __init__(self, actors: list):
        self.actors = actors

    def scorer(self, rank: int) -> RemoteReference:
        return RemoteReference(self.actors[rank % len(self.actors)])


class _Scorer(_Placed):
    """One actor of a scorer group (a reward model): builds its scorer once, then scores the sequences it is sent."""

    def setup(self, threads: int, build: Callable, args: tuple) -> None:
        import torch

        torch.set_num_threads(threads)
        self.scorer = build(*args)

    def score(self, sequences: list[list[int]]):
        return self.scorer.score(sequences)


class ScorerGroup:
    """Scorer actors behind one ``score(sequences) -> [N]``: the sequences are cut into contiguous shards of about
    equal tokens, one per actor, scored at once, and put back in order. Online RL hands one per ``--reward_pretrain``
    model to every rank (``stop`` None: a rank waits plainly; the driver acts on signals); ``score_on_ray`` runs one
    for ``openpack score``. A dead actor is a ``ScorerDiedError`` naming ``name`` and the actor's node."""

    def __init__(self, actors: list, stop: StopSignals | None, name: str = "scorer", nodes: list[str] | None = None):
        self.actors, self.stop, self.name, self.nodes = actors, stop, name, nodes or [None] * len(actors)

    def score(self, sequences: list[list[int]]):
        import torch

        bounds = _shard_bounds([len(s) for s in sequences], len(self.actors))
        shards = {i: (sequences[lo:hi],) for i, (lo, hi) in enumerate(bounds) if hi > lo}
        return torch.cat(self.call("score", list(shards.values()), list(shards))) if shards else torch.zeros(0)

    def call(self, method: str, per_actor_args: list[tuple], indices: list[int] | None = None) -> list:
        """``actor.method(*args)`` on each actor (``indices``: which ones; default all), their results in order."""
        import ray

        indices = list(range(len(self.actors))) if indices is None else indices
        refs = [getattr(self.actors[i], method).remote(*args) for i, args in zip(indices, per_actor_args)]
        try:
            return _get(refs, self.stop) if self.stop else ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            dead = next((i for i, ref in zip(indices, refs) if _failed(ref)), indices[0])
            where = f" on node {self.nodes[dead]}" if self.nodes[dead] else ""
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
            raise ScorerDiedError(f"{self.name}: actor {dead} of {len(self.actors)}{where} died ({first_line}); "
                                  "its log is in the Ray session logs (/tmp/ray/session_latest/logs)") from err


def _failed(ref) -> bool:
    """Whether a finished Ray call raised (a pending one is not known to have failed)."""
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref)
    except Exception:  # noqa: BLE001 - any failure marks the actor
        return True
    return False


def _shard_bounds(lengths: list[int], shards: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) index ranges, one per shard, each about total / shards tokens."""
    total, bounds, lo, done = sum(lengths), [], 0, 0
    for shard in range(1, shards + 1):
        hi = lo
        while hi < len(lengths) and (shard == shards or done + lengths[hi] <= total * shard / shards or hi == lo):
            done += lengths[hi]
            hi += 1
        bounds.append((lo, hi))
        lo = hi
    return bounds


def score_on_ray(build: Callable, args: tuple, sequences: list[list[int]], *, num_nodes: int,
                 num_gpus_per_node: int, num_cpus_per_worker: int | None, ray_address: str | None = None):
    """``build(*args).score(...)`` over ``sequences`` on a group of ``num_nodes x num_gpus_per_node`` scorer actors.

    Ray's life cycle is the training launcher's: attach or start a local cluster, actors placed in a placement
    group, everything stopped on return, on an error, on Ctrl-C or SIGTERM (``Stopped``).
    """
    import ray

    world = num_nodes * num_gpus_per_node
    with StopSignals(defer=True) as stop, _Session() as session, _memory_kills_named(None):
        if not ray.is_initialized():
            session.owned = True
            connect(ray_address, world * (num_cpus_per_worker or 1), stop, session)
        cpus = num_cpus_per_worker or default_cpus_per_worker(num_gpus_per_node)
        actors, nodes = session.start_group(_Scorer, "reward", world, cpus, stop)
        _get([actor.setup.remote(cpus, build, args) for actor in actors], stop)
        return ScorerGroup(actors, stop, "reward model", nodes).score(sequences)


def cluster_address(ray_address: str | None) -> str | None:
    """The cluster to attach to, None to start a local one; ``ClusterUnreachable`` when nothing answers there.

    Ray retries an address with nothing behind it for minutes (more than 600 s for ``--ray_address`` on a
    closed port), so the driver first opens a TCP connection to it, 5 s at most. ``auto`` means ``$RAY_ADDRESS``
    or the cluster ``ray start`` recorded on this machine, not (as in Ray's fallback) whatever Ray process is
    running here, which may be another command's private local cluster or one being torn down.
    """
    env = os.environ.get("RAY_ADDRESS")
    address, source = (ray_address, "--ray_address") if ray_address else (env, "$RAY_ADDRESS")
    if not address or address == "local":
        return None
    fix = "drop --ray_address to start a local cluster" if source == "--ray_address" else "unset RAY_ADDRESS"
    if address == "auto":
        recorded = _recorded_cluster()
        if env:
            address, source = env, "--ray_address auto: $RAY_ADDRESS"
        elif os.path.exists(recorded):
            with open(recorded) as f:
                address, source = f.read().strip(), f"--ray_address auto: {recorded} names"
        else:
            raise ClusterUnreachable(f"--ray_address auto: no Ray cluster was started on this machine (no {recorded}); "
                                     f"start one with `ray start --head`, or {fix}")
    host, _, port = address.split("://")[-1].rpartition(":")
    if not port.isdigit():
        raise ClusterUnreachable(f"{source} {address}: not host:port (e.g. 10.0.0.1:6379, or auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as err:
        raise ClusterUnreachable(f"{source} {address}: no Ray cluster answers there ({_reason(err)}); start one "
                                 f"with `ray start --head --port {port}` on that node, fix the address, or {fix}")
    return address


def _recorded_cluster() -> str:
    """The file ``ray start --head`` writes its address to (Ray's own rule for its temp folder)."""
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(tmp, "ray", "ray_current_cluster")


def _reason(err: OSError) -> str:
    return (err.strerror or str(err) or type(err).__name__).lower()


def connect(address: str | None, cpus_needed: int, stop: StopSignals, session: _Session) -> None:
    """Attach to ``address`` (checked by ``cluster_address``), else start a local cluster watched by a watchdog."""
    import ray

    if address:
        # A cluster on loopback (tests, one machine) must be joined from loopback too, or Ray swaps
        # in the machine's interface address and never reaches the head node.
        local = address.split("://")[-1].split(":")[0] in ("127.0.0.1", "localhost")
        with stop.during_ray_init():
            ray.init(address=address, log_to_driver=True, **({"_node_ip_address": "127.0.0.1"} if local else {}))
        return
    cpus = max(cpus_needed, os.cpu_count() or 1)
    print(f"ray: starting a local cluster on 127.0.0.1 ({cpus} CPUs)", flush=True)
    # Ray starts its workers at niceness 15 (RAY_worker_niceness): the ranks and engines, which do all the work,
    # then got about 3% of a core beside any other busy process (a DPO demo stalled for 20 minutes in a DeepSpeed
    # op build beside two CPU hogs). They run at the driver's priority instead, unless the user set it.
    os.environ.setdefault("RAY_worker_niceness", "0")
    session.watchdog = start_watchdog()
    with stop.during_ray_init():  # always a new cluster (never one left running), sized to the workers asked for
        ray.init(address="local", num_cpus=cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=True)


def default_cpus_per_worker(ranks_per_node: int) -> int:
    """A GPU node's CPUs per GPU; on CPU-only nodes, the smallest node's CPUs shared by its ranks."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    gpu_nodes = [n for n in nodes if n.get("GPU")]
    if gpu_nodes:
        return max(1, min(int(n["CPU"] // n["GPU"]) for n in gpu_nodes))
    return max(1, min(int(n.get("CPU", 1)) for n in nodes) // ranks_per_node)


def launch(worker: Callable, args: tuple, kwargs: dict, rank_kwargs: list[dict], *, num_nodes: int,
           num_gpus_per_node: int, num_cpus_per_worker: int | None, ray_address: str | None = None,
           reference: ReferenceGroupSpec | None = None, engines: EngineGroupSpec | None = None,
           rewards: list[ScorerGroupSpec] | None = None, memory_advice: str | None = None,
           teacher: ReferenceGroupSpec | None = None):
    """Run ``worker(*args, **kwargs, **rank_kwargs[rank])`` on every rank; returns rank 0's result.

    ``rewards`` (online RL): one actor group per reward model, each in its own placement group, handed to every
    rank as ``reward_groups``; ``teacher`` (online RL's distillation teacher) a group like ``reference``, handed
    to every rank as ``teacher_group``. ``ray_address`` is ``cluster_address``'s answer; ``memory_advice`` (``lower --max_tokens_per_gpu 16384 (try
    8192)``) is what a rank killed for memory is told. Raises ``Stopped`` on Ctrl-C or SIGTERM.
    """
    import ray

    world = num_nodes * num_gpus_per_node
    frozen = {name: (spec, spec.num_nodes * spec.num_gpus_per_node)
              for name, spec in (("reference", reference), ("teacher", teacher)) if spec is not None}
    for name, (_, ranks) in frozen.items():
        if ranks > world or world % ranks:
            raise ValueError(f"{ranks} {name} ranks must divide the {world} policy ranks")
    ref_world = sum(ranks for _, ranks in frozen.values())
    if engines is not None and engines.num_engines > 1:  # each engine holds a model and its KV cache
        fewer = f"fewer --vllm_num_engines than {engines.num_engines}"
        memory_advice = f"{memory_advice}, or {fewer}" if memory_advice else fewer
    with StopSignals(defer=True) as stop, _Session() as session, _memory_kills_named(memory_advice):
        own_engines = engines is not None and not engines.colocate  # colocated engines take no CPUs of their own
        scorers = sum(spec.num_actors for spec in rewards or [])
        if not ray.is_initialized():
            session.owned = True
            connect(ray_address, (world + ref_world + scorers) * (num_cpus_per_worker or 1) +
                    (engines.num_engines if own_engines else 0), stop, session)
        if own_engines:  # first: an engine loads its model while the ranks start
            kwargs = {**kwargs, "engine_group": _start_engines(session, engines, stop)}
        sharing = num_gpus_per_node + sum(spec.num_gpus_per_node for spec, _ in frozen.values())
        cpus = num_cpus_per_worker or default_cpus_per_worker(sharing + scorers +
                                                              (engines.num_engines if own_engines else 0))
        if rewards:
            kwargs = {**kwargs, "reward_groups": [_start_scorers(session, spec, cpus, stop) for spec in rewards]}
        for name, (spec, ranks) in frozen.items():
            ref_actors, ref_nodes = session.start_group(_Teacher if name == "teacher" else _Reference, name, ranks,
                                                        cpus, stop)
            _get([a.setup.remote(env, spec.build, spec.args)
                  for a, env in zip(ref_actors, _rank_envs(ref_actors, ref_nodes, cpus, stop))], stop)
            kwargs = {**kwargs, f"{name}_group": ReferenceGroup(ref_actors)}
        if engines is not None and engines.colocate:  # the engines load (and sleep) before the ranks take memory
            group = session.reserve("rank", world, cpus)
            kwargs = {**kwargs, "engine_group": _start_engines(session, engines, stop, group)}
            actors, nodes = session.place(_Rank, "rank", group, world, stop, share=1 - ENGINE_SHARE)
        else:
            actors, nodes = session.start_group(_Rank, "rank", world, cpus, stop)
        envs = _rank_envs(actors, nodes, cpus, stop)
        inbox = ray.remote(num_cpus=0)(_Inbox).remote()
        session.actors.append(inbox)
        runs = [a.run.remote(envs[r], worker, args, {**kwargs, **rank_kwargs[r]}, inbox if r == 0 else None)
                for r, a in enumerate(actors)]
        return _wait(runs, nodes, inbox, session.relay, stop, memory_advice)[0]


class _Session:
    """What the driver started on Ray, undone on exit whatever ended the run (also half-way through a start)."""

    def __init__(self):
        from openpack.trainers.tracking import ConsoleRelay

        self.owned, self.watchdog = False, None
        self.groups: list = []
        self.actors: list = []
        self.relay = ConsoleRelay()

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc) -> None:
        import ray

        self.relay.close()  # the live bar stops before the driver's last line
        undo = [(ray.kill, actor) for actor in self.actors]
        undo += [(ray.util.remove_placement_group, group) for group in self.groups]
        undo += [(ray.shutdown,)] if self.owned else []
        for call, *arg in undo:
            with contextlib.suppress(Exception):  # one failure must not keep the rest from being undone
                call(*arg)
        if self.watchdog is not None:  # kills what the shutdown left (Ray's agents linger for a minute)
            stop_watchdog(self.watchdog)

    def start_group(self, cls, name: str, world: int, cpus: int, stop: StopSignals, init_args: tuple = (),
                    gpus_per_actor: int = 1, init_kwargs: dict | None = None, class_options: dict | None = None):
        """``world`` actors of ``cls(*init_args, **init_kwargs)``, one per bundle of a new placement group; prints where
        each runs (waiting for every constructor). ``class_options``: ``ray.remote``'s for the class (concurrency
        groups)."""
        group = self.reserve(name, world, cpus, gpus_per_actor)
        return self.place(cls, name, group, world, stop, init_args, init_kwargs, class_options=class_options)

    def reserve(self, name: str, world: int, cpus: int, gpus_per_actor: int = 1):
        """A placement group of ``world`` bundles of ``cpus`` CPUs and, where the cluster has enough, GPUs."""
        import ray
        from ray.util.placement_group import placement_group

        gpus = gpus_per_actor if ray.cluster_resources().get("GPU", 0) >= world * gpus_per_actor else 0
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        print(f"ray: placing {world} {name} actors, one per bundle of {bundle}", flush=True)
        group = placement_group([bundle] * world, strategy="PACK")
        self.groups.append(group)
        return group

    def place(self, cls, name: str, group, count: int, stop: StopSignals, init_args: tuple = (),
              init_kwargs: dict | None = None, share: float = 1.0, class_options: dict | None = None):
        """``count`` actors on bundles 0.. of ``group``, each claiming ``share`` of its bundle's CPUs and GPUs
        (less than 1 where two actors share a bundle: ``--colocate_all_models``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _get([group.ready()], stop)
        remote = ray.remote(**class_options)(cls) if class_options else ray.remote(cls)
        for index in range(count):
            bundle = group.bundle_specs[index]
            self.actors.append(remote.options(
                num_cpus=bundle["CPU"] * share, num_gpus=bundle.get("GPU", 0) * share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=index),
            ).remote(*init_args, **(init_kwargs or {})))
        actors = self.actors[-count:]
        placed = _get([a.node.remote() for a in actors], stop)
        for index, (node, pid) in enumerate(placed):
            print(f"ray: {name} {index} pid {pid} on node {node}", flush=True)
        return actors, [node for node, _ in placed]


def _start_engines(session: _Session, spec: EngineGroupSpec, stop: StopSignals, ranks=None):
    """The engine actors, ready (model loaded), as the ``EngineGroup`` every rank is handed. ``ranks``: the ranks'
    placement group, for colocated engines (engine i on rank i's bundle, asleep until the first generation)."""
    from openpack.rollout.engine_group import EngineGroup, engine_actor_options
    from openpack.rollout.interface import EngineStartError, last_error_line
    from openpack.rollout.vllm_engine import VLLMEngine

    class _Engine(_Placed, VLLMEngine):
        """A vLLM rollout engine in a Ray actor, placed like every other actor."""

    import ray

    init_kwargs = dict(spec.options, tensor_parallel_size=spec.tensor_parallel_size)
    try:
        if ranks is None:
            actors, _ = session.start_group(_Engine, "vllm engine", spec.num_engines, 1, stop, (spec.model_path,),
                                            spec.tensor_parallel_size, init_kwargs,
                                            class_options=engine_actor_options(spec.in_flight))
            return EngineGroup(actors, remote=True, in_flight=spec.in_flight)
        actors, _ = session.place(_Engine, "vllm engine", ranks, spec.num_engines, stop, (spec.model_path,),
                                  init_kwargs, share=ENGINE_SHARE)
    except ray.exceptions.RayActorError as error:  # the constructor raised: its traceback is in the error's text
        if "EngineStartError" not in str(error):
            raise
        raise EngineStartError(last_error_line(str(error)).split(": ", 1)[1]) from error
    group = EngineGroup(actors, remote=True)
    group.sleep()
    return group


def _start_scorers(session: _Session, spec: ScorerGroupSpec, cpus: int, stop: StopSignals) -> ScorerGroup:
    """A reward model's actors in a placement group of their own, each with its model loaded."""
    actors, nodes = session.start_group(_Scorer, f"reward model {spec.name}", spec.num_actors, cpus, stop)
    group = ScorerGroup(actors, stop, f"reward model {spec.name}", nodes)
    group.call("setup", [(cpus, spec.build, spec.args)] * len(actors))  # a death while loading is named too
    group.stop = None  # in the ranks: a plain wait (the driver acts on signals)
    return group


def _get(refs: list, stop: StopSignals) -> list:
    """``ray.get(refs)``, waiting ``POLL_S`` at a time so a Ctrl-C or SIGTERM is acted on within that."""
    import ray

    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        stop.check()
    return ray.get(refs)


def _rank_envs(actors: list, nodes: list[str], cpus: int, stop: StopSignals) -> list[dict]:
    """The torch.distributed environment of each actor: rank 0's node and a free port there are the rendezvous."""
    world = len(actors)
    master_addr, master_port = _get([actors[0].rendezvous.remote()], stop)[0]
    envs = []
    for rank in range(world):
        local_ranks = [r for r in range(world) if nodes[r] == nodes[rank]]
        envs.append({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": master_addr,
                     "MASTER_PORT": str(master_port), "LOCAL_RANK": str(local_ranks.index(rank)),
                     "LOCAL_WORLD_SIZE": str(len(local_ranks)), "OMP_NUM_THREADS": str(cpus)})
    return envs


def _wait(runs: list, nodes: list[str], inbox, relay, stop: StopSignals, memory_advice: str | None) -> list:
    """Results of every rank, failing as soon as one rank fails (the others may hang in a collective).

    Every ``POLL_S``: rank 0's console events are shown and a stop signal is acted on. When a rank dies, the
    others' collectives fail too ("Connection reset by peer" from gloo), sometimes before Ray reports the death:
    so after a first error the driver waits up to ``DEATH_GRACE_S`` for the rest, and reports a death first.
    """
    import ray

    oom_before = oom_kills()
    pending, errors, deadline = list(runs), {}, None
    while pending and (deadline is None or time.monotonic() < deadline):
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        for event in _get([inbox.take.remote()], stop)[0]:
            relay.show(event)
        stop.check()
        for ref in done:
            try:
                ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError,
                    ray.exceptions.OutOfMemoryError) as err:
                errors[runs.index(ref)] = err
        if errors and deadline is None:
            deadline = time.monotonic() + DEATH_GRACE_S
    if errors:
        raise _failure(errors, nodes, oom_before, memory_advice)
    for event in _get([inbox.take.remote()], stop)[0]:  # rank 0 flushed its last events before returning
        relay.show(event)
    return ray.get(runs)


def _failure(errors: dict, nodes: list[str], oom_before: int | None, memory_advice: str | None) -> Exception:
    """The error to report for the failed ranks: a dead rank before the errors it caused in the others."""
    import ray

    for rank, err in sorted(errors.items()):
        if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)):
            return RankDiedError(_how_rank_died(rank, nodes[rank], err, oom_before, memory_advice))
    for rank, err in sorted(errors.items()):
        if isinstance(err.cause, ray.exceptions.OutOfMemoryError):  # an actor the rank called: reference, engine
            text = str(err.cause)
            return RankDiedError(f"ray: {_killed_actor(text)}, called by rank {rank}, "
                                 f"{_memory_kill(text, memory_advice)}; the last checkpoint is intact: "
                                 "rerun with --load_checkpoint to resume")
    rank, err = min(errors.items())
    if isinstance(err.cause, ray.exceptions.RayActorError):  # a rank lost its reference (or teacher) actor
        who = "a teacher actor" if "_Teacher" in str(err.cause) else "a reference actor"
        return RankDiedError(f"ray: {who} died ({err.cause}); the last checkpoint is intact: "
                             "rerun with --load_checkpoint to resume")
    return err.cause if err.cause is not None else err


def _how_rank_died(rank: int, node: str, err, oom_before: int | None, memory_advice: str | None) -> str:
    import ray

    text = str(err)
    here = node.split("/")[-1] == ray.get_runtime_context().get_node_id()[:8]
    oom_now = oom_kills() if here else None
    advice = f": {memory_advice}" if memory_advice else ""
    monitor = "running low on memory" in text or "memory pressure" in text  # its actor-death wording
    if isinstance(err, ray.exceptions.OutOfMemoryError) or monitor:
        how, advice = _memory_kill(text, memory_advice), ""
    elif "node has died" in text:
        how, advice = "was lost with its node (the node died or left the cluster)", ""
    elif oom_before is not None and oom_now is not None and oom_now > oom_before:
        how = "was killed by the kernel's OOM killer (out of memory)"
    elif "unexpectedly exit" in text:
        how = "was killed by the OS (SIGKILL), probably out of memory"
    else:
        how, advice = f"died ({text.strip().splitlines()[-1][:300]})", ""
    return (f"ray: rank {rank} on node {node} {how}{advice}; the last checkpoint is intact: "
            "rerun with --load_checkpoint to resume")


_ROLES = {"_Rank": "a rank actor", "_Reference": "a reference actor", "_Teacher": "a distillation teacher actor",
          "_Scorer": "a reward model actor",
          "_Engine": "a vLLM engine", "_Inbox": "rank 0's console inbox"}


@contextlib.contextmanager
def _memory_kills_named(memory_advice: str | None):
    """A Ray call on an actor Ray's memory monitor killed raises ``OutOfMemoryError`` wherever the driver waits
    (placing actors, loading models, polling the console): one ``RankDiedError`` line naming the actor."""
    import ray

    try:
        yield
    except ray.exceptions.OutOfMemoryError as err:
        raise RankDiedError(f"ray: {_killed_actor(str(err))} {_memory_kill(str(err), memory_advice)}") from err


def _killed_actor(text: str) -> str:
    """The actor Ray's memory monitor report says it killed ("task name=_Rank.run, ... pid=123"): its role."""
    selected = text.split("Selected to kill", 1)[-1]  # Ray >= 2.56 also lists the workers it considered
    task, pid = re.search(r"name=(\w+)\.", selected), re.search(r"pid=(\d+)", selected)
    who = _ROLES.get(task[1], f"a Ray worker ({task[1]})") if task else "a Ray worker"
    return f"{who} (pid {pid[1]})" if pid else who


def _memory_kill(text: str, memory_advice: str | None) -> str:
    """The clause 'was killed by Ray's memory monitor (figures): fixes', the node's memory figures and threshold
    read from Ray's report where its wording is one of these (else left out):

        Ray 2.60: "... was 3.00GB used / 23.54GB limit (0.127451)
                   OOM kill reason: Memory usage 3218427904B exceeded threshold of 1263803264B (5.0% of ...B limit)"
        older:    "... was running was 7.00GB / 7.50GB (0.933), which exceeds the memory usage threshold of 0.9."
    """
    figures = re.search(r"was ([\d.]+) ?GB(?: used)? / ([\d.]+) ?GB", text)
    percent = re.search(r"\(([\d.]+)% of \d+B limit\)", text)
    fraction = re.search(r"memory usage threshold of (\d+(?:\.\d+)?)", text)
    threshold = f"{float(percent[1]) / 100:g}" if percent else fraction[1] if fraction else None
    how = "was killed by Ray's memory monitor"
    if figures:
        above = f", over RAY_memory_usage_threshold {threshold}" if threshold else ""
        how += f" (the node's memory: {figures[1]}GB used / {figures[2]}GB limit{above})"
    fixes = [memory_advice, "free the memory other processes hold",
             "raise RAY_memory_usage_threshold where Ray starts (Ray's default 0.95)"]
    return f"{how}: " + ", or ".join(filter(None, fixes))


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup (v2, else v1), or
    on the whole machine when no cgroup counter can be read (``/proc/vmstat``); None when nothing can be read."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    candidates.append(f"/sys/fs/cgroup{path}/memory.events")
                elif "memory" in controllers.split(","):
                    candidates.append(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
    except OSError:
        pass
    for path in [*candidates, "/proc/vmstat"]:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None
