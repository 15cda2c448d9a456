"""Training on multi-turn episodes (issue 27) end to end on CPU: an OpenRLHF-protocol agent file trains unchanged
(without openrlhf installed), the update is exact under packing, prefix sharing, padding and world size, every
estimator trains on episodes, per-turn credit is the outcome reward where only the last turn scores, and
environments that raise, hang or answer the wrong type give the counted outcome.

The environments are deterministic and every turn's request is seeded by (run, step, episode, turn), so each
layout samples the same episodes (HF generation one request per call), as in test_train_ppo.py.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from openpack.cli import train_grpo
from openpack.distributed.process import free_port

from hang_guard import HANG_S
from saved_runs import assert_same_run, read_metrics

COMMON = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "2",
          "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
          "--max_norm", "100", "--adam_epsilon", "1e-6", "--max_steps", "2", "--rollout_backend", "hf",
          "--launcher", "local"]
PACKED = ["--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "96"]

# OpenRLHF's documented agent file: AgentExecutor over an AgentInstance, tensor rewards, text feedback appended.
OPENRLHF_AGENT = '''
    import torch
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.turn = 0

        async def reset(self, states: dict, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states: dict, **kwargs):
            self.turn += 1
            action = states["action_text"]
            reward = torch.tensor(action.count("a") * 0.5 - 0.05 * len(action))
            done = self.turn >= 2
            return {"rewards": reward, "scores": reward, "environment_feedback": "" if done else " again: ",
                    "done": done, "sampling_params": states.get("sampling_params"),
                    "extra_logs": {"turn": self.turn}}


    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)
'''

# Native: three turns, rewarded on the last only (per-turn credit then equals the outcome reward).
LAST_TURN = '''
    class ThreeTurns:
        async def reset(self, sample):
            self.turn = 0
            return sample["prompt"]

        async def step(self, action):
            self.turn += 1
            done = self.turn == 3
            return {"observation": "" if done else f" turn {self.turn}: ", "reward": action.count("e") if done else 0.0,
                    "done": done}
'''

# Native, per row: "ok", or fail as the row's "mode" says.
FAULTY = '''
    import asyncio


    class Faulty:
        async def reset(self, sample):
            self.mode = sample["mode"]
            return sample["prompt"]

        async def step(self, action):
            if self.mode == "raise":
                raise RuntimeError("the tool server is down")
            if self.mode == "hang":
                await asyncio.Event().wait()
            if self.mode == "type":
                return ["not", "a", "step"]
            return {"observation": None, "reward": action.count("a"), "done": True}
'''


def env_file(root, text, name):
    path = root / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def grpo(save_path, rl_model, agent_flags, *flags):
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--save_path", str(save_path), *agent_flags, *COMMON, *flags]
    assert train_grpo.main(argv) == 0
    return save_path


@pytest.fixture(scope="module")
def openrlhf_flags(tmp_path_factory):
    return ["--agent_func_path", env_file(tmp_path_factory.mktemp("agent"), OPENRLHF_AGENT, "agent.py")]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, rl_model, openrlhf_flags):
    return grpo(tmp_path_factory.mktemp("agent_ref") / "run", rl_model, openrlhf_flags, *PACKED,
                "--no_prefix_sharing")


def test_an_openrlhf_agent_file_trains_and_logs_its_episodes(reference_run):
    metrics = read_metrics(reference_run)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["optimizer_steps"] == 4  # 16 episodes in steps of 8, 2 epochs
        assert m["reward_std"] > 0 and m["advantages/std"] > 0
        assert 1 <= m["turns/mean"] <= 2
        assert 0 < m["episode_tokens/masked_fraction"] < 1  # observations are in the rows, not trained
        assert m["episode_tokens/mean"] > m["response_length/mean"]
        assert m["episodes/dropped_groups"] == 0
        assert m["vllm_logp_diff"] < 1e-4  # the trainer scores the ids HF sampled, at the sampled positions
        assert 1 <= m["env/turn"] <= 2  # the file's extra_logs
    assert metrics[0]["turns/mean"] == 2  # two turns unless the token budget ends an episode first
    assert metrics[0]["episodes/done"] == 16


@pytest.mark.parametrize("layout", ["prefix_shared", "padded"])
def test_episode_layouts_give_the_same_steps(layout, reference_run, tmp_path, rl_model, openrlhf_flags):
    """Episodes packed one a segment, prefix-shared (the group's first observation once), or padded one a row:
    the same losses, grad norms and weights."""
    flags = PACKED if layout == "prefix_shared" else ["--micro_train_batch_size", "2"]
    run = grpo(tmp_path / layout, rl_model, openrlhf_flags, *flags)
    assert_same_run(run, reference_run)
    if layout == "prefix_shared":
        assert all(m["prefix_sharing/token_ratio"] < 0.95 for m in read_metrics(run))


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_episodes(reference_run, tmp_path, rl_model, openrlhf_flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "openpack.cli.main", "train_grpo", "--pretrain", str(rl_model / "model"), "--prompt_data",
           str(rl_model / "prompts.jsonl"), "--save_path", str(tmp_path / "two"), *openrlhf_flags, *COMMON[:-2],
           *PACKED, "--no_prefix_sharing"]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(tmp_path / "two", reference_run)


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "gae"])
def test_every_estimator_trains_on_episodes(estimator, tmp_path, rl_model, openrlhf_flags):
    run = grpo(tmp_path / estimator, rl_model, openrlhf_flags, *PACKED, "--advantage_estimator", estimator,
               "--max_steps", "1", *(["--loss_agg_mode", "seq_mean_token_sum_norm"] if estimator == "dr_grpo" else []))
    (m,) = read_metrics(run)
    assert m["optimizer_steps"] == 4 and m["advantages/std"] > 0
    if estimator == "gae":
        assert m["critic_loss"] > 0 and (run / "critic" / "model.safetensors").exists()


def test_per_turn_credit_of_a_last_turn_reward_is_the_outcome_reward(tmp_path, rl_model):
    """REINFORCE++ on three-turn episodes rewarded at their last turn: crediting each turn's reward to its last
    token puts the whole reward on the episode's last sampled token, as the outcome reward does."""
    flags = ["--env_file", env_file(tmp_path, LAST_TURN, "three.py")]
    outcome = grpo(tmp_path / "outcome", rl_model, flags, *PACKED, "--advantage_estimator", "reinforce",
                   "--max_turns", "3", "--max_episode_tokens", "64")
    per_turn = grpo(tmp_path / "per_turn", rl_model, flags, *PACKED, "--advantage_estimator", "reinforce",
                    "--max_turns", "3", "--max_episode_tokens", "64", "--per_turn_reward")
    assert_same_run(per_turn, outcome)
    assert read_metrics(outcome)[0]["turns/mean"] > 2


def faulty_prompts(root, modes):
    path = root / "faulty.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"sort: {w}\n", "mode": m}) + "\n"
                            for w, m in zip(["cab", "bca", "acb", "bac"], modes)))
    return path


def test_raising_hanging_and_wrong_typed_environments_are_counted_and_left_out(tmp_path, rl_model):
    prompts = faulty_prompts(tmp_path, ["ok", "raise", "hang", "type"])
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(prompts), "--save_path", str(tmp_path / "run"),
            "--env_file", env_file(tmp_path, FAULTY, "faulty.py"), "--env_timeout", "5",
            "--max_env_failure_fraction", "0.8", *COMMON, *PACKED, "--max_steps", "1"]
    assert train_grpo.main(argv) == 0
    (m,) = read_metrics(tmp_path / "run")
    assert (m["episodes/error"], m["episodes/timeout"], m["episodes/done"]) == (8, 4, 4)  # "type" is an error too
    assert m["episodes/dropped_groups"] == 3
    assert m["optimizer_steps"] == 2  # the one whole group: 4 episodes, one step of 4 (not 8) an epoch


def test_too_many_failed_episodes_stop_the_run_with_one_line(tmp_path, rl_model, capsys):
    prompts = faulty_prompts(tmp_path, ["ok", "raise", "ok", "ok"])
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(prompts), "--save_path", str(tmp_path / "run"),
            "--env_file", env_file(tmp_path, FAULTY, "faulty.py"), "--max_env_failure_fraction", "0.2", *COMMON,
            *PACKED, "--max_steps", "1"]
    assert train_grpo.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "4 of 16 episodes ended with an environment error or timeout" in err, err
    assert "--max_env_failure_fraction 0.2" in err and "RuntimeError: the tool server is down" in err, err


@pytest.mark.parametrize("flags, message", [
    (["--env_file", "{root}/missing.py"], "--env_file {root}/missing.py: not a Python file"),
    (["--env_file", "{agent}", "--tools", "{agent}"], "--env_file and --tools: give one environment"),
    (["--agent_func_path", "{agent}", "--reward_fn", "{root}/reward.py:reward"],
     "the environment gives each episode its reward"),
    (["--agent_func_path", "{agent}", "--per_turn_reward"], "--advantage_estimator group_norm (one scalar per"),
    (["--max_turns", "3", "--env_timeout", "5"], "--max_turns, --env_timeout bound multi-turn episodes: add"),
])
def test_bad_agent_flags_are_named(flags, message, rl_model, tmp_path, capsys, openrlhf_flags):
    agent = openrlhf_flags[1]
    flags = [f.format(root=rl_model, agent=agent) for f in flags]
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"), "--save_path",
            str(tmp_path / "run"), *flags, *COMMON]
    assert train_grpo.main(argv) == 2
    assert message.format(root=rl_model) in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.parametrize("partial", [[], ["--partial_rollout"]], ids=["async", "partial"])
def test_an_openrlhf_agent_file_trains_through_vllm_asynchronously(tmp_path, rl_model, openrlhf_flags, partial):
    """In a subprocess, as a user runs it (an in-process engine tears down torch.distributed's default group), with
    the next batch's episodes running on the engine while this one trains (--async_train, one version late); with
    --partial_rollout the weight push lands in those episodes' turns, and batch 2's trained tokens are all or
    partly the older version's (each turn's tokens keep theirs). Synchronous vLLM episodes with --tools are the
    agent demo's (test_agent_demo.py)."""
    save_path = tmp_path / "run"
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--save_path", str(save_path), *openrlhf_flags, *COMMON[:-4], "--rollout_backend", "vllm",
            "--launcher", "local", "--async_train", *partial, *PACKED]
    result = subprocess.run([sys.executable, "-m", "openpack.cli.main", "train_grpo", *argv], capture_output=True,
                            text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(save_path)
    assert [m["async/staleness"] for m in metrics] == [0.0, 1.0]  # batch 2 sampled before update 1
    assert metrics[0]["vllm_logp_diff"] < 1e-4, metrics[0]  # vLLM's log-probs of its own ids, turn after turn
    for m in metrics:  # (batch 2's are the older policy's: its difference measures the staleness too)
        assert m["turns/mean"] > 1 and m["episodes/dropped_groups"] == 0
    assert metrics[0]["async/old_version_tokens"] == 0 and 0 < metrics[1]["async/old_version_tokens"] <= 1
