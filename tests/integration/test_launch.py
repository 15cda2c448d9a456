"""What ``launch`` does before and around the workers, whatever the launcher (issue 12, item 3).

- ``--ray_address`` naming no cluster fails at once with one line (exit 2) instead of Ray retrying for more
  than 600 s, and so does ``--ray_address auto`` with no ``ray start`` cluster. Addresses are on loopback,
  on a port bound here but never listened on, so the connection is refused and no traffic leaves the machine.
- SIGTERM ends a ``--launcher local`` run as Ctrl-C does, with exit code 143.

Each test runs the CLI in a subprocess (signals, and Ray's own retries, would hit the test process otherwise).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from hang_guard import HANG_S

FLAGS = ["--train_batch_size", "8", "--max_len", "64", "--packing_samples", "--use_dynamic_batch",
         "--max_tokens_per_gpu", "128"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def closed_port():
    """A loopback port bound here and never listened on: a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def ray_tmpdir():
    """An empty Ray temp folder (short: Ray puts unix sockets in it), so no `ray start` cluster is recorded."""
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    yield path
    subprocess.run(["rm", "-rf", path])


def train_sft(tmp_path, tiny_pretrain, sft_jsonl, *flags, env=ENV):
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_sft", "--pretrain", tiny_pretrain,
                             "--dataset", sft_jsonl, "--save_path", str(tmp_path / "run"), *FLAGS, *flags],
                            capture_output=True, text=True, timeout=HANG_S, env=env)
    return result, time.time() - started


def test_ray_address_with_no_cluster_there_fails_in_seconds(tmp_path, tiny_pretrain, sft_jsonl, closed_port):
    result, seconds = train_sft(tmp_path, tiny_pretrain, sft_jsonl, "--ray_address", f"127.0.0.1:{closed_port}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert seconds < 30
    error = result.stderr.strip().splitlines()
    assert len(error) == 1, result.stderr
    assert f"--ray_address 127.0.0.1:{closed_port}" in error[0] and "ray start --head" in error[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_ray_address_auto_with_no_cluster_running_fails_in_seconds(tmp_path, tiny_pretrain, sft_jsonl, closed_port,
                                                                  ray_tmpdir):
    """None recorded, then one recorded by an earlier `ray start` that has since stopped (the file stays)."""
    env = {**ENV, "RAY_TMPDIR": ray_tmpdir}
    env.pop("RAY_ADDRESS", None)
    result, seconds = train_sft(tmp_path, tiny_pretrain, sft_jsonl, "--ray_address", "auto", env=env)
    assert result.returncode == 2 and seconds < 30, result.stderr[-3000:]
    assert "--ray_address auto" in result.stderr and "ray start --head" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    os.makedirs(os.path.join(ray_tmpdir, "ray"))
    with open(os.path.join(ray_tmpdir, "ray", "ray_current_cluster"), "w") as f:
        f.write(f"127.0.0.1:{closed_port}")
    result, seconds = train_sft(tmp_path, tiny_pretrain, sft_jsonl, "--ray_address", "auto", env=env)
    assert result.returncode == 2 and seconds < 30, result.stderr[-3000:]
    assert f"127.0.0.1:{closed_port}" in result.stderr and "--ray_address auto" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow
def test_sigterm_stops_a_local_run_like_ctrl_c(tmp_path, tiny_pretrain, sft_jsonl):
    """Before: Python's default SIGTERM killed the process where it stood (exit -15, no message)."""
    driver = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", "train_sft", "--pretrain", tiny_pretrain,
                               "--dataset", sft_jsonl, "--save_path", str(tmp_path / "run"), *FLAGS,
                               "--max_epochs", "1000", "--launcher", "local"],  # 6000 steps (not 100000 epochs: 30 s of planning)
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            break
    driver.send_signal(signal.SIGTERM)
    output, _ = driver.communicate(timeout=60)
    output = "".join(lines) + output
    assert driver.returncode == 143, output[-3000:]
    assert "openpack: terminated (SIGTERM)" in output and "Traceback" not in output
