"""``ray start --head`` then ``ray job submit -- openpack train_sft ...``, as docs/multinode.md and OpenRLHF's
scripts launch (issue 41).

Before: openpack installed bare ``ray``, whose head node starts no job server, so ``ray job submit`` could not
connect to :8265. Now it installs ``ray[default]``. Ray 2.60's head turns on token authentication when a token
exists (every local ``ray.init`` writes one to ``~/.ray/auth_token``), and ``ray job submit`` then needs
``RAY_AUTH_MODE=token``; the docs export it for every command, and so does this test.

The test runs the documented commands in a home folder of its own (the token Ray generates there is this
test's), a Ray temp folder of its own and free loopback ports (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every
address on 127.0.0.1). It stops only the head it started (its ``ray start --block`` process and what that
started): ``ray stop`` would stop every Ray cluster on the machine.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from hang_guard import HANG_S

from saved_runs import BARE_PROMPTS, read_metrics

BIN = os.path.dirname(sys.executable)  # ray and openpack, as the install put them beside this python
SFT = ["--train_batch_size", "8", "--max_steps", "2", "--max_len", "64", "--num_gpus_per_node", "2",
       "--num_cpus_per_worker", "1", *BARE_PROMPTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray(*args, env):
    return subprocess.run([os.path.join(BIN, "ray"), *args], capture_output=True, text=True, env=env, timeout=600)


def start_head(env, log_path, dashboard_port: int) -> subprocess.Popen:
    """``ray start --head`` (blocking, so this test owns its processes) on free ports; returns once it serves."""
    ports = {flag: free_port() for flag in ("--port", "--ray-client-server-port", "--dashboard-agent-listen-port",
                                            "--metrics-export-port")}
    head = subprocess.Popen([os.path.join(BIN, "ray"), "start", "--head", "--block", "--num-cpus=2",
                             f"--dashboard-port={dashboard_port}", "--disable-usage-stats",
                             *(f"{flag}={port}" for flag, port in ports.items())],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while "Ray runtime started" not in open(log_path).read():
        assert head.poll() is None, f"ray start --head exited {head.returncode}:\n{open(log_path).read()[-3000:]}"
        assert time.time() < deadline, f"ray start --head: no cluster after 600 s:\n{open(log_path).read()[-3000:]}"
        time.sleep(1)
    return head


def stop_head(head: subprocess.Popen) -> None:
    """The head's processes, and only those: SIGTERM to ``ray start``, then a kill of what outlives it."""
    started = psutil.Process(head.pid).children(recursive=True)
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    _, alive = psutil.wait_procs(started, timeout=30)
    for process in alive:
        process.kill()


def wait_for_job(job_id: str, address: str, env) -> tuple[str, str]:
    """Poll ``ray job status`` until the job ends (a guard against a hang, not a speed bound); (status, logs)."""
    ends = {f"Job '{job_id}' succeeded": "SUCCEEDED", f"Job '{job_id}' failed": "FAILED",
            f"Job '{job_id}' was stopped": "STOPPED"}  # what `ray job status` (2.60) prints for an ended job
    deadline = time.time() + HANG_S
    while True:
        status = ray("job", "status", job_id, "--address", address, env=env)
        ended = [end for line, end in ends.items() if line in status.stdout + status.stderr]
        if ended or time.time() > deadline:
            logs = ray("job", "logs", job_id, "--address", address, env=env)
            return (ended or ["still running after the deadline"])[0], logs.stdout + logs.stderr
        time.sleep(2)


@pytest.mark.slow
def test_ray_job_submit_runs_train_sft_on_a_head_node(tmp_path, tiny_pretrain, sft_jsonl):
    ray_tmp = subprocess.run(["mktemp", "-d", "/tmp/rjXXXXXX"], capture_output=True, text=True,
                             check=True).stdout.strip()  # short: Ray's unix sockets live in it
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    generated = ray("get-auth-token", "--generate", env=env)
    assert generated.returncode == 0 and (home / ".ray" / "auth_token").is_file(), generated.stderr[-2000:]

    dashboard_port = free_port()
    address = f"http://127.0.0.1:{dashboard_port}"
    head = start_head(env, tmp_path / "head.log", dashboard_port)
    try:
        save_path = tmp_path / "run"
        submitted = ray("job", "submit", "--address", address, "--submission-id", "openpack-sft", "--no-wait", "--",
                        "openpack", "train_sft", "--pretrain", tiny_pretrain, "--dataset", sft_jsonl,
                        "--save_path", str(save_path), *SFT, env=env)
        assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
        status, logs = wait_for_job("openpack-sft", address, env)
    finally:
        stop_head(head)
        subprocess.run(["rm", "-rf", ray_tmp])

    assert status == "SUCCEEDED", logs[-4000:]
    assert "Connecting to existing Ray cluster at address: 127.0.0.1:" in logs, logs[-4000:]  # RAY_ADDRESS of the job
    assert "starting a local cluster" not in logs and "ray: placing 2 rank actors" in logs, logs[-4000:]
    assert [m["step"] for m in read_metrics(save_path)] == [1, 2]
    assert (save_path / "model" / "model.safetensors").is_file()
