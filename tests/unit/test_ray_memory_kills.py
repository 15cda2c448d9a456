"""Ray's memory monitor killing an actor becomes one line: which actor, the node's memory figures, the fixes.

Ray raises ``OutOfMemoryError`` for any call on the killed actor (not an actor error): in the driver for a
rank's own task, or inside a rank, wrapped in its ``RayTaskError``, for the reference actor or engine it called.
The reports below are Ray 2.60's text as a killed rank produced it (``RAY_memory_usage_threshold=0.05``, trimmed)
and the older wording the issue quotes. The CLI run is test_ray_launcher.py's
``test_a_rank_killed_by_rays_memory_monitor_is_one_line``.
"""

import types

import ray
from ray.exceptions import OutOfMemoryError, RayTaskError

from openpack.orchestration import ray_launcher
from openpack.orchestration.ray_launcher import RankDiedError, _failure, _killed_actor, _memory_kill

RAY_2_60 = """1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1, ID: \
aa91ac3ad76ce1748a5b579c3d14734b3c4b8898f5e92521e5998802) was 3.00GB used / 23.54GB limit (0.127451)
OOM kill reason: Memory usage 3218427904B exceeded threshold of 1263803264B (5.0% of 25276063744B limit)
Ray killed 1 worker(s) based on the killing policy
Considered workers: [
Selected to kill: (Actor(bf175ba8d404e190d8dadd7101000000): job ID=01000000, lease ID=0000, \
task name=_Reference.segment_sums, required resources={CPU_group_0_7206: 2}, pid=16999, actual memory used=0.04GB, \
worker ID=2e4d5bc8)
]
Top 10 memory users: PID	MEM(GB)	COMMAND
13882	0.46	ray::_Rank.run
"""
OLDER = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.1, ID: 1a2b) where "
         "the task (actor ID: 3c4d, name=_Rank.__init__, pid=4321, memory used=0.10GB) was running was 7.00GB / "
         "7.50GB (0.933), which exceeds the memory usage threshold of 0.9. Ray killed this worker (ID: 5e6f) because "
         "it was the most recently scheduled task")
ADVICE = "lower --max_tokens_per_gpu 160 (try 80)"
FIXES = (f": {ADVICE}, or free the memory other processes hold, or raise RAY_memory_usage_threshold where Ray starts "
         "(Ray's default 0.95)")


def test_the_killed_actor_and_the_node_memory_figures_are_read_from_rays_report():
    assert _killed_actor(RAY_2_60) == "a reference actor (pid 16999)"  # the selected one, not a top memory user
    assert _memory_kill(RAY_2_60, ADVICE) == ("was killed by Ray's memory monitor (the node's memory: 3.00GB used / "
                                              "23.54GB limit, over RAY_memory_usage_threshold 0.05)" + FIXES)
    assert _killed_actor(OLDER) == "a rank actor (pid 4321)"
    assert _memory_kill(OLDER, ADVICE) == ("was killed by Ray's memory monitor (the node's memory: 7.00GB used / "
                                           "7.50GB limit, over RAY_memory_usage_threshold 0.9)" + FIXES)


def test_a_report_in_another_wording_still_gives_one_line():
    assert _killed_actor("the node ran out of memory") == "a Ray worker"
    assert _memory_kill("the node ran out of memory", None) == (
        "was killed by Ray's memory monitor: free the memory other processes hold, or raise "
        "RAY_memory_usage_threshold where Ray starts (Ray's default 0.95)")


def test_a_rank_killed_comes_before_the_errors_its_death_caused(monkeypatch):
    """Rank 1's own task raised OutOfMemoryError; rank 0's collective then failed (gloo's reset)."""
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "ffffffff"))
    monkeypatch.setattr(ray_launcher, "oom_kills", lambda: None)
    reset = RayTaskError("run", "Traceback ...", RuntimeError("Connection reset by peer"))
    error = _failure({0: reset, 1: OutOfMemoryError(RAY_2_60)}, ["127.0.0.1/aa91ac3a"] * 2, None, ADVICE)
    assert isinstance(error, RankDiedError)
    assert str(error) == ("ray: rank 1 on node 127.0.0.1/aa91ac3a was killed by Ray's memory monitor (the node's "
                          "memory: 3.00GB used / 23.54GB limit, over RAY_memory_usage_threshold 0.05)" + FIXES +
                          "; the last checkpoint is intact: rerun with --load_checkpoint to resume")


def test_an_actor_a_rank_called_killed_names_the_actor_and_the_rank():
    """Rank 1's call on its reference actor raised OutOfMemoryError inside the rank: the driver sees a RayTaskError."""
    reset = RayTaskError("run", "Traceback ...", RuntimeError("Connection reset by peer"))
    lost = RayTaskError("run", "Traceback ...", OutOfMemoryError(RAY_2_60))
    error = _failure({0: reset, 1: lost}, ["127.0.0.1/aa91ac3a"] * 2, None, ADVICE)
    assert isinstance(error, RankDiedError)
    assert str(error).startswith("ray: a reference actor (pid 16999), called by rank 1, was killed by Ray's memory "
                                 "monitor (the node's memory: 3.00GB used / 23.54GB limit")
    assert "\n" not in str(error)
