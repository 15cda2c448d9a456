"""Ray, the default launcher: one actor per rank (CPU workers here) gives the same run as one local process.

Each Ray test runs the real CLI in a subprocess, so the Ray cluster it starts
is torn down with it. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray
resolve every node address to loopback, so all test traffic stays on
127.0.0.1. The local baselines run in-process with ``--launcher local``.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from saved_runs import BARE_PROMPTS, assert_same_run, read_metrics
from openpack.cli import train_dpo
from hang_guard import HANG_S

SFT = ["--train_batch_size", "8", "--max_steps", "2", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
       "--lr_scheduler", "constant", "--max_len", "64", "--seed", "1", "--max_norm", "100",
       "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128", *BARE_PROMPTS]
DPO = [*SFT[:12], "--max_len", "48", "--seed", "1", "--max_norm", "100", "--loss_type", "sigmoid",
       "--nll_loss_coef", "0.5", "--beta", "0.5", "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu",
       "160", "--adam_epsilon", "1e-6"]  # as test_train_dpo.py: with 1e-8 a float-noise gradient fails the weight check
# A run that is still going when the test stops it (hours at ~0.3 s a step). Not 100000 epochs: planning
# 600000 steps took the driver 30 s before the first one.
FOREVER = ["--max_epochs", "1000", "--max_steps", "6000"]
TWO_WORKERS = ["--num_gpus_per_node", "2", "--num_cpus_per_worker", "1"]

LOOPBACK_RAY = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def openpack(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                          timeout=HANG_S, env={**LOOPBACK_RAY, **(env or {})})


def rank_pids(output: str) -> dict[int, int]:
    return {int(m[1]): int(m[2]) for m in re.finditer(r"ray: rank (\d+) pid (\d+)", output)}


@pytest.fixture(scope="module")
def dpo_args(tiny_pretrain, tiny_reference, dpo_jsonl):
    return ["--pretrain", tiny_pretrain, "--ref_pretrain", tiny_reference, "--dataset", dpo_jsonl, *DPO]


@pytest.fixture(scope="module")
def local_dpo(tmp_path_factory, dpo_args):
    """One local process, reference colocated: the run every Ray layout must reproduce."""
    save_path = tmp_path_factory.mktemp("local_dpo")
    assert train_dpo.main([*dpo_args, "--save_path", str(save_path), "--launcher", "local"]) == 0
    return save_path


@pytest.mark.slow
def test_dpo_runs_through_ray_by_default_and_two_workers_equal_one_local_rank(tmp_path, dpo_args, local_dpo):
    result = openpack("train_dpo", *dpo_args, "--save_path", str(tmp_path / "ray"), *TWO_WORKERS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(rank_pids(result.stdout)) == [0, 1]  # no --launcher given: Ray
    # rank 0's progress reaches the driver, which prints it as --launcher local does (not a terminal: plain lines)
    assert re.search(r"^step 2/2  loss [\d.]+  tokens/s \d+  packing [\d.]+%  eta 0:00:00$", result.stdout, re.M)
    assert_same_run(tmp_path / "ray", local_dpo)


@pytest.mark.slow
def test_separate_reference_group_equals_colocated(tmp_path, dpo_args, local_dpo):
    """2 policy ranks and 2 reference actors (ZeRO-3 inside each group) == 1 local rank with its own reference."""
    result = openpack("train_dpo", *dpo_args, "--save_path", str(tmp_path / "ref_group"), *TWO_WORKERS,
                      "--zero_stage", "3", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"ray: reference \d pid", result.stdout)) == 2, result.stdout
    assert_same_run(tmp_path / "ref_group", local_dpo)


def test_reference_group_flag_checks(dpo_args, tmp_path, capsys):
    out = ["--save_path", str(tmp_path)]
    assert train_dpo.main([*dpo_args, *out, "--launcher", "local", "--ref_num_nodes", "1"]) == 2
    assert "needs --launcher ray" in capsys.readouterr().err
    assert train_dpo.main([*dpo_args, *out, "--num_gpus_per_node", "3", "--ref_num_nodes", "1",
                           "--ref_num_gpus_per_node", "2"]) == 2
    assert "must divide the 3 policy ranks" in capsys.readouterr().err
    assert train_dpo.main([*dpo_args, *out, "--ref_num_nodes", "1", "--ref_logps_cache", str(tmp_path / "c")]) == 2
    assert "drop one of them" in capsys.readouterr().err


TWO_NODES = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # all traffic stays on loopback
from openpack.cli import train_dpo
import os
os.environ["RAY_ADDRESS"] = cluster.address  # as `ray job submit` sets it for the command
code = train_dpo.main(sys.argv[1:] + ["--num_nodes", "2", "--num_gpus_per_node", "1"])
import ray
ray.shutdown()  # the driver disconnects before the cluster's nodes go
cluster.shutdown()
sys.exit(code)
"""


@pytest.mark.slow
def test_simulated_two_node_cluster(tmp_path, dpo_args, local_dpo):
    """Two Ray nodes of one CPU each: one rank lands on each, and train_dpo equals one local rank."""
    result = subprocess.run([sys.executable, "-c", TWO_NODES, *dpo_args, "--save_path", str(tmp_path / "two_nodes")],
                            capture_output=True, text=True, timeout=HANG_S, env=LOOPBACK_RAY)
    assert result.returncode == 0, result.stderr[-3000:]
    nodes = {line.split(" on node ")[1] for line in result.stdout.splitlines() if line.startswith("ray: rank ")}
    assert len(nodes) == 2, result.stdout
    assert_same_run(tmp_path / "two_nodes", local_dpo)


@pytest.mark.slow
def test_a_rank_killed_by_rays_memory_monitor_is_one_line(tmp_path, dpo_args):
    """Issue 24: other processes' memory made Ray's memory monitor kill a rank, and train_dpo died with a 40-line
    traceback (``ray.exceptions.OutOfMemoryError``). At ``RAY_memory_usage_threshold=0`` the raylet the launcher
    starts kills the first actor it sees, on any machine and under any load: the driver prints one line naming
    the actor, the node's memory figures and the fixes."""
    result = openpack("train_dpo", *dpo_args, "--save_path", str(tmp_path / "out"),
                      env={"RAY_memory_usage_threshold": "0"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    killed = [line for line in result.stderr.splitlines() if "memory monitor" in line]
    assert len(killed) == 1, result.stderr[-3000:]
    match = re.fullmatch(r"openpack: ray: (.+?),? was killed by Ray's memory monitor \(the node's memory: "
                         r"[\d.]+GB used / [\d.]+GB limit, over RAY_memory_usage_threshold 0\): lower "
                         r"--max_tokens_per_gpu 160 \(try 80\), or free the memory other processes hold, or raise "
                         r"RAY_memory_usage_threshold where Ray starts \(Ray's default 0\.95\).*", killed[0])
    assert match and "rank" in match[1], killed[0]  # a rank actor (pid N) while starting; rank r on node X later


@pytest.mark.slow
def test_a_worker_data_error_reaches_the_user_as_one_line(tmp_path, tiny_pretrain):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "ab", "response": "ba"}) + "\n")
    result = openpack("train_sft", "--pretrain", tiny_pretrain, "--dataset", str(bad), "--save_path",
                      str(tmp_path / "out"), *TWO_WORKERS, *SFT)
    assert result.returncode == 2
    assert "bad.jsonl:1: no key 'prompt'" in result.stderr


class Driver:
    """The CLI in a subprocess: its output lines as they come, and every process below it while it lives."""

    def __init__(self, *argv, env=None, preexec_fn=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env or LOOPBACK_RAY,
                                     preexec_fn=preexec_fn)
        self.lines: list[str] = []
        self.tree: set[int] = set()
        self.started = time.time()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def _watch(self):  # the processes a driver starts are no longer its descendants once it is gone
        while self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
            time.sleep(0.2)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = HANG_S) -> None:
        deadline = time.time() + timeout
        while not re.search(pattern, self.output):
            assert self.proc.poll() is None and time.time() < deadline, f"no {pattern!r}:\n{self.output[-3000:]}"
            time.sleep(0.05)

    def stop(self, signum: int | None, timeout: float = 60) -> float:
        """Send ``signum`` (None: nothing); the seconds until the driver exited."""
        self.tree |= descendants(self.proc.pid)
        sent = time.time()
        if signum is not None:
            self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the driver was still running {timeout} s after signal {signum}:\n"
                                 + self.output[-3000:]) from None
        return time.time() - sent

    def orphans(self, within: float = 20) -> list[str]:
        """The processes the driver started that are still alive ``within`` seconds from now."""
        deadline = time.time() + within
        while any(alive(pid) for pid in self.tree) and time.time() < deadline:
            time.sleep(0.2)
        return [command(pid) for pid in self.tree if alive(pid)]


def long_run(save_path, tiny_pretrain, sft_jsonl, *flags, preexec_fn=None) -> Driver:
    """A Ray run of 2 workers checkpointing every step that would go on for hours."""
    return Driver("train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *SFT, *FOREVER, "--save_steps", "1",
                  "--save_path", str(save_path), *TWO_WORKERS, *flags, preexec_fn=preexec_fn)


def as_a_background_step():
    """What a driver inherits when a non-interactive shell starts it with ``&`` (CI runners, job scripts): SIGINT
    ignored. Python then leaves it ignored, and before the fix the test's SIGINT was lost (issue 12: the run went
    on training). A blocked SIGINT, which a parent can leave too, is added."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc), zombies excluded."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def command(pid: int) -> str:
    try:
        return f"{pid} " + open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:100]
    except OSError:
        return f"{pid} (gone)"


@pytest.mark.slow
def test_a_killed_worker_is_reported_and_the_run_resumes(tmp_path, tiny_pretrain, sft_jsonl):
    """The OS kills rank 1 (SIGKILL, as the OOM killer does): the driver names the rank, the likely cause and the
    flag to lower with its value, and the run resumes from its last checkpoint."""
    driver = long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    driver.wait_for(r"step 2/")
    os.kill(rank_pids(driver.output)[1], signal.SIGKILL)
    assert driver.stop(None) < 60
    output = driver.output
    assert driver.proc.returncode == 1, output[-3000:]
    died = next((line for line in output.splitlines() if "rank 1 on node" in line), output[-3000:])
    assert "out of memory" in died and "lower --max_tokens_per_gpu 128 (try 64)" in died, died
    assert "--load_checkpoint" in died
    latest = int((tmp_path / "run" / "checkpoints" / "latest").read_text().strip().removeprefix("global_step"))
    resumed = openpack("train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl, *SFT, "--save_path",
                       str(tmp_path / "run"), *TWO_WORKERS, *FOREVER, "--load_checkpoint", "--max_steps", str(latest + 1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'} at step {latest}" in resumed.stdout + resumed.stderr
    assert read_metrics(tmp_path / "run")[-1]["step"] == latest + 1


@pytest.mark.slow
def test_ctrl_c_stops_every_worker(tmp_path, tiny_pretrain, sft_jsonl):
    """Ctrl-C between steps, to a driver started as a CI runner starts a step (``as_a_background_step``).

    The same run checks the driver's progress lines when stdout is not a terminal: rank 0 sends its console to
    the driver, which prints each step once, in the local launcher's format."""
    driver = long_run(tmp_path / "run", tiny_pretrain, sft_jsonl, preexec_fn=as_a_background_step)
    driver.wait_for(r"step 3/")
    pids = rank_pids(driver.output)
    assert sorted(pids) == [0, 1] and set(pids.values()) <= driver.tree | descendants(driver.proc.pid)
    # at the driver's priority, not Ray's default worker niceness of 15 (starved beside any busy process)
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids.values()} == {
        os.getpriority(os.PRIO_PROCESS, driver.proc.pid)}
    assert driver.stop(signal.SIGINT) < 30
    output = driver.output
    assert driver.proc.returncode == 130, output[-3000:]
    assert "openpack: interrupted; all Ray workers were stopped" in output
    assert not driver.orphans(), "orphans left behind"
    assert re.search(r"^step 2/6000  loss [\d.]+  tokens/s \d+  packing [\d.]+%  eta \d+:\d\d:\d\d$", output, re.M)
    assert not re.search(r"_Rank pid=\d+\S* step \d", output), "rank 0 printed its progress too"


@pytest.mark.slow
def test_ctrl_c_during_ray_start_up_stops_cleanly(tmp_path, tiny_pretrain, sft_jsonl):
    """Ray prints "Started a local Ray instance" just before ray.init builds its core worker. Before the fix a
    Ctrl-C there was raised inside that constructor: the launcher's cleanup never ran and the driver died of
    SIGSEGV ~5 s later (exit -11, the kernel log naming _raylet.so)."""
    driver = long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    driver.wait_for(r"Started a local Ray instance")
    assert driver.stop(signal.SIGINT) < 30
    assert driver.proc.returncode == 130, driver.output[-3000:]
    assert "openpack: interrupted; all Ray workers were stopped" in driver.output
    assert not driver.orphans(), "orphans left behind"


@pytest.mark.slow
def test_ctrl_c_while_placing_and_starting_actors_stops_cleanly(tmp_path, tiny_pretrain, sft_jsonl):
    driver = long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    driver.wait_for(r"ray: placing 2 rank")
    assert driver.stop(signal.SIGINT) < 30
    assert driver.proc.returncode == 130, driver.output[-3000:]
    assert not driver.orphans(), "orphans left behind"


@pytest.mark.slow
def test_sigterm_during_checkpoint_saves_stops_like_ctrl_c(tmp_path, tiny_pretrain, sft_jsonl):
    """What Slurm and Kubernetes send. Before the fix Ray's C++ signal handler took it and the driver died of
    SIGABRT. Now: 143 (128 + SIGTERM, what a shell and Slurm report for a job ended by SIGTERM), one line, no
    process left. A checkpoint is written every step, so the signal comes while one is being saved."""
    driver = long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    driver.wait_for(r"step 2/")
    assert driver.stop(signal.SIGTERM) < 30
    assert driver.proc.returncode == 143, driver.output[-3000:]
    assert "openpack: terminated (SIGTERM); all Ray workers were stopped" in driver.output
    assert not driver.orphans(), "orphans left behind"


@pytest.mark.slow
def test_a_killed_driver_leaves_no_ray_process(tmp_path, tiny_pretrain, sft_jsonl):
    """SIGKILL: the driver runs no code. Before the watchdog, Ray's two agents lived on for ~62 s (waiting for
    the dead GCS); now nothing the driver started is alive 15 s later."""
    driver = long_run(tmp_path / "run", tiny_pretrain, sft_jsonl)
    driver.wait_for(r"step 1/")
    time.sleep(1)  # the watchdog has seen the rank actors
    driver.stop(signal.SIGKILL)
    assert driver.tree, "no process was seen below the driver"
    assert not driver.orphans(within=15), "Ray processes outlived their driver"
