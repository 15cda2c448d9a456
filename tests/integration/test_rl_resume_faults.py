"""Online RL (issue 14, items 8 and 9): a resumed run equals an uninterrupted one, and faults end a run with a
message.

- Resume: an uninterrupted run checkpoints every step; a copy of it is rewound to its step-2 checkpoint (as a
  crash after step 2 leaves it: later checkpoints and the final model gone, ``latest`` naming step 2) and
  resumed with the same command. Per-step reward, policy loss, grad norm, response lengths, learning rate and the
  final weights must match to 1e-5. With ``--max_epochs 2`` and a cosine schedule with warmup, several updates
  per rollout make the optimizer and scheduler state matter. With vLLM in rank 0's process, the resumed run must
  push the policy's weights to the new engine before it generates, or step 3 samples from the start weights.
- A vLLM engine actor killed under Ray (SIGKILL, as the OOM killer does) is named by the driver, which exits 1
  within 60 s with the last checkpoint intact.
- A reward server that accepts and never answers is cut off by ``--remote_rm_timeout`` and its bounded retries;
  a reward function that returns NaN is named with the batch.

The model is a random tiny Llama with head_dim 32 (vLLM's CPU attention refuses 16), with the demo tokenizer.
The reward counts vowels, so the completions of a prompt get different rewards and GRPO's advantages are not 0.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from openpack.cli import train_grpo
from openpack.distributed.checkpoint import verify
from hang_guard import HANG_S
from saved_runs import assert_same_run, read_metrics, save_tiny_llama

RL = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
      "--train_batch_size", "16", "--generate_max_len", "8", "--prompt_max_len", "32", "--packing_samples",
      "--use_dynamic_batch", "--max_tokens_per_gpu", "512", "--learning_rate", "1e-3", "--seed", "1",
      "--max_norm", "100"]
COMPARED = ["reward", "reward_std", "policy_loss", "grad_norm", "response_length/mean", "response_length/max",
            "response_length/truncated", "entropy", "advantages/mean", "vllm_logp_diff", "lr"]
LOOPBACK_RAY = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
REWARDS = """
def vowels(prompts, completions, rows):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


_calls = []


def nan_on_second_batch(prompts, completions, rows):
    _calls.append(len(completions))
    rewards = vowels(prompts, completions, rows)
    if len(_calls) == 2:
        rewards[5] = float("nan")
    return rewards
"""


@pytest.fixture(scope="module")
def rl_task(tmp_path_factory):
    """``--pretrain`` and ``--prompt_data`` of a tiny vLLM-compatible Llama, and the reward file's path."""
    path = tmp_path_factory.mktemp("rl_task")
    save_tiny_llama(path / "model", seed=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256)
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in zip(range(3, 99, 6), range(90, -6, -6))]  # 16 prompts: 4 batches
    (path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (path / "rewards.py").write_text(REWARDS)
    return {"args": ["--pretrain", str(path / "model"), "--prompt_data", str(path / "prompts.jsonl")],
            "rewards": path / "rewards.py"}


def grpo_flags(rl_task, save_path, *flags, reward="vowels"):
    return [*rl_task["args"], "--reward_fn", f"{rl_task['rewards']}:{reward}", *RL, "--save_path", str(save_path),
            *flags]


def openpack(*argv, timeout=HANG_S):
    return subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env=LOOPBACK_RAY)


def rewound(run: Path, to: Path, step: int) -> Path:
    """A copy of ``run`` as a crash after step ``step`` leaves it: later checkpoints and the final model gone."""
    shutil.copytree(run, to)
    for folder in (to / "checkpoints").glob("global_step*"):
        if int(folder.name.removeprefix("global_step")) > step:
            shutil.rmtree(folder)
    (to / "checkpoints" / "latest").write_text(f"global_step{step}")
    shutil.rmtree(to / "model")
    return to


def assert_same_metrics(resumed: Path, full: Path) -> None:
    a, b = read_metrics(resumed), read_metrics(full)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in COMPARED:
            assert x[key] == pytest.approx(y[key], abs=1e-5, rel=0), (x["step"], key, x[key], y[key])


@pytest.mark.parametrize("schedule", [[], ["--max_epochs", "2", "--lr_scheduler", "cosine", "--lr_warmup_ratio",
                                           "0.25"]], ids=["one_update", "two_epochs_cosine"])
def test_a_resumed_hf_run_equals_the_uninterrupted_one(tmp_path, rl_task, schedule, capsys):
    flags = ["--launcher", "local", "--rollout_backend", "hf", "--max_steps", "4", "--save_steps", "1", *schedule]
    assert train_grpo.main(grpo_flags(rl_task, tmp_path / "full", *flags)) == 0
    full = read_metrics(tmp_path / "full")
    assert all(m["advantages/std"] > 0.1 for m in full), "the reward gives the group no variance"
    if schedule:
        assert [m["optimizer_steps"] for m in full] == [2] * 4 and len({m["lr"] for m in full}) == 4
    resumed = rewound(tmp_path / "full", tmp_path / "resumed", 2)
    capsys.readouterr()
    assert train_grpo.main(grpo_flags(rl_task, resumed, *flags, "--load_checkpoint")) == 0
    assert f"resumed from {resumed / 'checkpoints'} at step 2" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4]
    assert_same_metrics(resumed, tmp_path / "full")
    assert_same_run(resumed, tmp_path / "full")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_resumed_vllm_run_pushes_the_policy_to_its_engine_before_generating(tmp_path, rl_task):
    flags = ["--launcher", "local", "--rollout_backend", "vllm", "--max_steps", "3", "--save_steps", "1"]
    result = openpack("train_grpo", *grpo_flags(rl_task, tmp_path / "full", *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = rewound(tmp_path / "full", tmp_path / "resumed", 2)
    result = openpack("train_grpo", *grpo_flags(rl_task, resumed, *flags, "--load_checkpoint"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoints'} at step 2" in result.stdout + result.stderr
    # step 3's completions come from the engine: with the start weights its reward, lengths and the
    # trainer-vs-vLLM log-prob gap would differ from the uninterrupted run's
    assert read_metrics(resumed)[-1]["vllm_logp_diff"] < 1e-3
    assert_same_metrics(resumed, tmp_path / "full")
    assert_same_run(resumed, tmp_path / "full")


class Run:
    """The CLI in a subprocess; its stdout and stderr lines as they come."""

    def __init__(self, *argv):
        self.proc = subprocess.Popen([sys.executable, "-m", "openpack.cli.main", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=LOOPBACK_RAY)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, l=lines: l.extend(s), daemon=True).start()

    def wait_for(self, found, what: str, timeout: float = HANG_S):
        deadline = time.time() + timeout
        while not (answer := found()):
            assert self.proc.poll() is None and time.time() < deadline, \
                f"no {what}:\n{''.join(self.out)[-2000:]}\n{''.join(self.err)[-3000:]}"
            time.sleep(0.1)
        return answer

    def exit_code(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {timeout} s later:\n{''.join(self.err)[-3000:]}") from None


@pytest.mark.vllm
@pytest.mark.slow
def test_a_dead_vllm_engine_is_named_and_the_last_checkpoint_is_intact(tmp_path, rl_task):
    run = Run("train_grpo", *grpo_flags(rl_task, tmp_path, "--rollout_backend", "vllm", "--num_episodes", "1000",
                                        "--save_steps", "1"))
    try:
        engine = int(run.wait_for(lambda: re.search(r"^ray: vllm engine 0 pid (\d+) on node ", "".join(run.out),
                                                    re.M), "engine actor")[1])
        run.wait_for(lambda: (tmp_path / "checkpoints" / "latest").exists(), "checkpoint")
        os.kill(engine, signal.SIGKILL)
        killed = time.time()
        code = run.exit_code(timeout=60)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert time.time() - killed < 60
    err = "".join(run.err)
    assert code == 1, err[-3000:]
    died = next((line for line in err.splitlines() if line.startswith("openpack: vLLM engine 0 of 1")), err[-3000:])
    assert f"pid {engine} died" in died, died
    assert "the last checkpoint is intact: rerun with --load_checkpoint to resume" in died, died
    assert "Traceback" not in err
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert verify(tmp_path / "checkpoints" / latest) is None
    assert not (tmp_path / "run.lock").exists()


class SilentServer:
    """A loopback TCP server that accepts connections, reads nothing and never answers; it notes each accept."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.accepted: list[float] = []
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(time.time())
            self.held.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_reward_server_that_hangs_is_cut_off_by_its_timeout(tmp_path, rl_task):
    """4 tries of 1 s with pauses of 1, 2 and 4 s between them (rewards.remote_reward's default), then exit 1: the
    server never answers, so the run ends only because each try timed out (no bound on how fast: a loaded
    machine only stretches the run)."""
    server = SilentServer()
    try:
        result = openpack("train_grpo", *rl_task["args"], *RL, "--save_path", str(tmp_path), "--launcher", "local",
                          "--rollout_backend", "hf", "--remote_rm_url", server.url, "--remote_rm_timeout", "1")
    finally:
        server.close()
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(server.accepted) == 4
    assert "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"openpack train_grpo: --remote_rm_url {server.url}: no answer after 4 tries"), last
    assert "timeout 1 s each" in last, last
    assert not (tmp_path / "run.lock").exists()


def test_a_reward_function_that_returns_nan_is_named_with_the_batch(tmp_path, rl_task, capsys):
    flags = grpo_flags(rl_task, tmp_path, "--launcher", "local", "--rollout_backend", "hf", "--max_steps", "3",
                       reward="nan_on_second_batch")
    assert train_grpo.main(flags) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"openpack train_grpo: --reward_fn {rl_task['rewards']}:nan_on_second_batch returned nan for "
                    "completion 5 of rollout batch 2 (1 not finite): every reward must be a finite number"), last
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]
