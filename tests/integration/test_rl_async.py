"""Asynchronous training (issue 15, item 4): ``--async_train --max_staleness N`` generates rollout batch k + 1 with
policy version k while batch k trains.

- N = 0 is the synchronous loop: the same losses, grad norms and final weights, step for step (in-process vLLM).
- N = 1: batch k >= 1 was sampled by version k - 1 (``async/staleness`` 1.0), its old log-probs come from the
  current policy (so the vLLM/trainer gap is no longer ~0), and the run completes.
- Resume: a run rewound to its step-2 checkpoint starts with an empty pipeline; every prompt is trained exactly
  once over the interrupted and the resumed run, batch 3 fresh (staleness 0), batch 4 one version old.
- The stale-sample guard and the pipeline's order, with a fake engine (no vLLM).

vLLM runs in subprocesses: an in-process engine ends torch.distributed's default group when it shuts down.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from openpack.cli import train_grpo
from openpack.distributed.process import DistInfo
from openpack.rollout.interface import Completion, SamplingConfig
from openpack.rl.generation import Generator
from openpack.rl.pipeline import RolloutPipeline, drop_stale
from openpack.rl.episodes import Rollouts
from hang_guard import HANG_S
from saved_runs import assert_same_run, read_metrics
from test_rl_resume_faults import LOOPBACK_RAY, RL, rewound, rl_task  # noqa: F401 (rl_task: a fixture)

LOGGED_REWARD = """
import json, os


def logged(prompts, completions, rows):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps(sorted(set(prompts))) + "\\n")
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]
"""
VLLM = ["--launcher", "local", "--rollout_backend", "vllm", "--vllm_is_correction_cap", "2"]


@pytest.fixture(scope="module")
def task(rl_task, tmp_path_factory):  # noqa: F811
    reward = tmp_path_factory.mktemp("async_reward") / "logged.py"
    reward.write_text(LOGGED_REWARD)
    return {**rl_task, "reward": f"{reward}:logged"}


def grpo(task, save_path, *flags, log=None, vllm=VLLM):
    argv = ["train_grpo", *task["args"], "--reward_fn", task["reward"], *RL, *vllm, "--save_path", str(save_path),
            *flags]
    env = {**LOOPBACK_RAY, "REWARD_LOG": str(log or save_path.parent / f"{save_path.name}.rewards")}
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", *argv], capture_output=True, text=True,
                            timeout=HANG_S, env=env, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return save_path


def logged_batches(path) -> list[list[str]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.vllm
def test_staleness_0_is_the_synchronous_loop(task, tmp_path):
    sync = grpo(task, tmp_path / "sync", "--max_steps", "3")
    async0 = grpo(task, tmp_path / "async0", "--max_steps", "3", "--async_train", "--max_staleness", "0")
    assert_same_run(async0, sync)
    for a, s in zip(read_metrics(async0), read_metrics(sync)):
        assert a["async/staleness"] == 0 and a["async/dropped_stale"] == 0
        for key in ("reward", "vllm_logp_diff", "response_length/mean"):
            assert a[key] == pytest.approx(s[key], abs=1e-6), key


@pytest.fixture(scope="module")
def async_run(task, tmp_path_factory):
    """--max_staleness 1 over 4 rollout batches, a checkpoint after each."""
    return grpo(task, tmp_path_factory.mktemp("async1") / "run", "--max_steps", "4", "--save_steps", "1",
                "--async_train", "--max_staleness", "1")


@pytest.mark.vllm
def test_staleness_1_trains_each_batch_one_version_late(async_run):
    metrics = read_metrics(async_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["async/staleness"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["async/dropped_stale"] == 0 for m in metrics)
    # the ratio's denominator is the current policy's (a scoring pass), vLLM's log-probs the previous version's
    assert metrics[0]["vllm_logp_diff"] < 1e-4
    assert all(m["vllm_logp_diff"] > 1e-3 for m in metrics[1:]), [m["vllm_logp_diff"] for m in metrics]
    assert all("async/generation_wait_s" in m for m in metrics)
    assert (async_run / "model" / "model.safetensors").exists()


@pytest.mark.vllm
def test_a_resumed_async_run_trains_every_prompt_once(async_run, task, tmp_path):
    resumed = rewound(async_run, tmp_path / "resumed", 2)
    grpo(task, resumed, "--max_steps", "4", "--save_steps", "1", "--async_train", "--max_staleness", "1",
         "--load_checkpoint", log=tmp_path / "resumed.rewards")
    full = logged_batches(async_run.parent / "run.rewards")
    trained = full[:2] + logged_batches(tmp_path / "resumed.rewards")
    assert trained == full  # the same batches in the same order
    prompts = [p for batch in trained for p in batch]
    assert len(prompts) == len(set(prompts)) == 16  # every prompt of the one episode, once
    assert [m["async/staleness"] for m in read_metrics(resumed)] == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.vllm
def test_rollout_corrections_act_on_stale_samples(task, tmp_path):
    """--max_staleness 1: rollout batch 2 was sampled by the weights before batch 1's update, so the trainer/vLLM
    ratios w_t differ from 1 (its vllm_logp_diff, the mean |log w_t|, was 0.19 on a 2-core EPYC; batch 1's 1e-7).
    icepop with the band exp(-0.2)..exp(0.2) then masks the tokens whose |log w_t| passes 0.2, some and not all;
    batch 1 (the same weights, w_t = 1 to the rounding) masks none. The ratios' mean and maximum are logged."""
    band = [f"{math.exp(-0.2):.9f}", f"{math.exp(0.2):.9f}"]
    run = grpo(task, tmp_path / "icepop", "--max_steps", "2", "--async_train", "--max_staleness", "1",
               "--is_correction_type", "icepop", "--is_correction_threshold", *band, vllm=VLLM[:-2])
    first, second = read_metrics(run)
    assert first["is_correction/masked_tokens"] == 0 and first["is_correction/ratio_max"] < math.exp(1e-4)
    assert second["vllm_logp_diff"] > 0.02, second  # the stale samples really differ
    assert 0 < second["is_correction/masked_tokens"] < 1, second
    assert 0 < second["is_correction/masked_sequences"] <= 1
    assert second["is_correction/ratio_max"] >= second["is_correction/ratio_mean"] and \
        abs(second["is_correction/ratio_mean"] - 1) < 0.1


@pytest.mark.vllm
def test_partial_rollouts_train_and_count_the_tokens_older_versions_sampled(task, tmp_path):
    """--partial_rollout through the command (in-process vLLM): each weight push pauses the engine between two
    sampling steps and resumes it, the run completes, and the update logs the share of its tokens sampled by a
    version older than the one trained: none for batch 1 (version 0 samples and trains it); for the later batches,
    asked for one version early, more than none (every completion's first token is the older version's) and at
    most all (where a push landed mid-completion, the tokens after it are the trained version's: 0.89 for batch 3
    on a loaded 2-core EPYC). Where the push lands is a race here; tests/integration/test_rollout_vllm.py places
    it by hand and checks the tokens and their log-probs."""
    run = grpo(task, tmp_path / "partial", "--max_steps", "3", "--async_train", "--partial_rollout")
    metrics = read_metrics(run)
    assert [m["async/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    shares = [m["async/old_version_tokens"] for m in metrics]
    assert shares[0] == 0 and all(0 < share <= 1 for share in shares[1:]), shares
    assert (run / "model" / "model.safetensors").exists()


@pytest.mark.parametrize("flags,fix", [
    ([], "drop --async_train, or use --rollout_backend vllm"),
    (["--partial_rollout"], "drop --partial_rollout, or use --rollout_backend vllm")])
def test_async_with_hf_rollouts_is_refused(rl_task, tmp_path, capsys, flags, fix):  # noqa: F811
    argv = [*rl_task["args"], "--reward_fn", f"{rl_task['rewards']}:vowels", *RL, "--save_path", str(tmp_path),
            "--launcher", "local", "--rollout_backend", "hf", "--async_train", *flags]
    assert train_grpo.main(argv) == 2
    assert fix in capsys.readouterr().err


def test_partial_rollouts_need_generation_beside_training():
    """--partial_rollout lands weights in a generation under way: a synchronous run (no --async_train) or one that
    generates nothing ahead (--max_staleness 0) has none, and is refused naming the fix."""
    from openpack.config.rl import CONFIGS
    from openpack.config.schema import ConfigError, parse_config

    def rollout_cfg(*argv):
        return parse_config(list(argv), "openpack train_ppo", "", *CONFIGS)[4]

    with pytest.raises(ConfigError, match="this run is synchronous: add --async_train, or drop --partial_rollout"):
        rollout_cfg("--partial_rollout")
    with pytest.raises(ConfigError, match="--max_staleness 0: no generation is under way"):
        rollout_cfg("--async_train", "--max_staleness", "0", "--partial_rollout")
    assert rollout_cfg("--async_train", "--partial_rollout").partial_rollout


def test_max_staleness_without_async_train_is_refused_and_defaults_to_1_with_it(tmp_path):
    """Before, an explicit --max_staleness without --async_train (its default was 1) was ignored in silence: the
    loop stayed synchronous. Now a value given by flag or --config file is refused, naming both flags and the fix;
    unset, it is 1 under --async_train and 0 (synchronous) without."""
    from openpack.config.rl import CONFIGS
    from openpack.config.schema import ConfigError, parse_config
    from openpack.rl.settings import async_staleness

    def rollout_cfg(*argv):
        return parse_config(list(argv), "openpack train_ppo", "", *CONFIGS)[4]

    with pytest.raises(ConfigError, match=r"--max_staleness 2 .*--async_train.*add --async_train, or drop "
                                          r"--max_staleness"):
        rollout_cfg("--max_staleness", "2")
    (tmp_path / "run.yaml").write_text("max_staleness: 0\n")
    with pytest.raises(ConfigError, match="--max_staleness 0"):
        rollout_cfg("--config", str(tmp_path / "run.yaml"))
    assert async_staleness(rollout_cfg()) == 0
    assert async_staleness(rollout_cfg("--async_train")) == 1
    assert async_staleness(rollout_cfg("--async_train", "--max_staleness", "3")) == 3


class FakeEngines:
    """Engines whose completion of a prompt is the weight version they hold when asked: [version]."""

    def __init__(self):
        self.version = 0
        self.asked: list[tuple[int, int]] = []  # (first prompt token, version) per generate

    def start_generate(self, prompts, sampling, seeds):
        version = self.version
        self.asked.append((prompts[0][0], version))
        return lambda: [[Completion([version], [-1.0], True)] * sampling.n for _ in prompts]


def pipeline_of(depth: int, steps: int = 4) -> tuple[RolloutPipeline, FakeEngines]:
    from openpack.data.prompts import Prompt

    engines = FakeEngines()
    generator = Generator("vllm", engines, SamplingConfig(n=2), seed=0, chunk=1)
    prompts = [Prompt([i], f"p{i}", {}, "fake") for i in range(steps)]
    return RolloutPipeline(generator, prompts, [[i] for i in range(steps)], depth, True), engines


DIST = DistInfo(0, 1, 0, torch.device("cpu"))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_pipeline_samples_batch_k_with_version_k_minus_depth(depth):
    pipeline, engines = pipeline_of(depth)
    for step in range(4):
        rollouts = pipeline.rollouts(step, DIST, version=step)
        assert rollouts.versions == [max(step - depth, 0)] * 2 == [t[0] for t in rollouts.completion_tokens]
        assert pipeline.metrics()["async/staleness"] == min(step, depth)
        engines.version += 1  # the weight sync after the step's update
    assert [prompt for prompt, _ in engines.asked] == [0, 1, 2, 3]  # each batch asked for once, in order


def test_a_batch_staler_than_the_bound_is_dropped_counted_and_generated_again():
    pipeline, engines = pipeline_of(depth=1)
    pipeline.rollouts(0, DIST, version=0)  # asks for batch 1 with version 0
    engines.version = 2
    rollouts = pipeline.rollouts(1, DIST, version=2)  # batch 1 is 2 versions old: past the bound
    assert pipeline.metrics()["async/dropped_stale"] == 2
    assert rollouts.versions == [2, 2] and pipeline.metrics()["async/staleness"] == 0


def test_drop_stale_keeps_samples_within_the_bound():
    rollouts = Rollouts([[1]] * 4, [[2], [3], [4], [5]], [[-1.0]] * 4, [True] * 4, versions=[3, 5, 4, 5])
    kept, dropped = drop_stale(rollouts, version=5, max_staleness=1)
    assert dropped == 1 and kept.versions == [5, 4, 5] and kept.completion_tokens == [[3], [4], [5]]
    assert drop_stale(rollouts, version=5, max_staleness=2) == (rollouts, 0)
