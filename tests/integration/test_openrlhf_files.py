"""OpenRLHF's reward and agent files run by train_ppo as OpenRLHF's example scripts pass them (issue 41, items 3-4).

- A reward file (``reward_func(queries, prompts, labels, **kwargs)``) given to ``--remote_rm_url`` (0.10's name) or
  ``--reward.remote_url`` (0.11's) trains, called as OpenRLHF 0.11 calls it: one query a call, the query being the
  prompt and the completion with its special tokens, the labels from ``--label_key``; it answers a dict of
  rewards/scores/extra_logs or a tensor. A file that imports ``openrlhf.utils``' math helpers runs without
  openrlhf installed.
- A reward file that cannot be used (missing, failing to import, no reward_func, a wrong signature) is refused
  in one line before the run starts; one that answers the wrong type stops the run naming the file and the answer.
- An OpenRLHF agent file gets the prompt rendered by the chat template (chat-message prompts used to reach its
  ``reset`` as lists, and every episode failed with "reset returned observation of type list").

The files below are written for these tests in the shapes of OpenRLHF's examples/python/ files.
"""

import importlib.util
import json
import textwrap

import pytest

from openpack.cli import train_ppo
from openpack.config import commands

from saved_runs import read_metrics

COMMON = ["--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8", "--max_steps", "1",
          "--generate_max_len", "8", "--prompt_max_len", "48", "--learning_rate", "1e-3", "--seed", "1",
          "--advantage_estimator", "reinforce", "--rollout_backend", "hf", "--launcher", "local",
          "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "128"]

# OpenRLHF's examples/python/reward_func.py shape: a dict of tensor rewards, scores and extra_logs. Each call is
# written to calls.jsonl beside the file.
DICT_REWARD = '''
    import json, pathlib
    import torch

    def reward_func(queries, prompts, labels, **kwargs):
        with open(pathlib.Path(__file__).with_name("calls.jsonl"), "a") as f:
            f.write(json.dumps({"queries": queries, "prompts": prompts, "labels": labels}) + "\\n")
        reward = torch.tensor([q.count("a") * 0.5 for q in queries])
        return {"rewards": reward, "scores": reward, "extra_logs": {"a": reward}}
'''

# examples/python/math_reward_func.py shape: OpenRLHF's math helpers, without openrlhf installed.
MATH_REWARD = '''
    import torch
    from openrlhf.utils import extract_boxed_answer, grade_answer

    def reward_func(queries, prompts, labels, **kwargs):
        rewards = []
        for query, prompt, label in zip(queries, prompts, labels):
            response = query[len(prompt):] if prompt in query else query
            rewards.append(float(grade_answer(extract_boxed_answer(response), label)))
        assert grade_answer(extract_boxed_answer("so \\\\boxed{\\\\frac{1}{2}}"), "0.5")
        return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards), "extra_logs": {}}
'''

# OpenRLHF's older example (examples/scripts/train_ppo_with_reward_fn.sh): the rewards alone, a tensor.
TENSOR_REWARD = '''
    import torch

    def reward_func(queries, prompts, labels):
        return torch.tensor([len(q) % 3 for q in queries], dtype=torch.float)
'''


# Scores that are not the rewards (examples/python/reward_func.py returns both): constant rewards, which give a
# group nothing to learn from, and scores counting the calls, which differ in every group; two extra logs.
SCORED_REWARD = '''
    import itertools, json, pathlib
    import torch

    calls = itertools.count()

    def reward_func(queries, prompts, labels, **kwargs):
        index = next(calls)
        with open(pathlib.Path(__file__).with_name("calls.jsonl"), "a") as f:
            f.write(json.dumps({"queries": queries, "score": index}) + "\\n")
        return {"rewards": torch.tensor([1.0]), "scores": torch.tensor([float(index)]),
                "extra_logs": {"query_chars": torch.tensor([len(queries[0])]), "one": 1.0}}
'''


def write(root, name, text):
    path = root / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def ppo(rl_model, save_path, *flags):
    argv = ["--pretrain", str(rl_model / "model"), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--save_path", str(save_path), *COMMON, *flags]
    return train_ppo.main(argv)


@pytest.mark.parametrize("flag", ["--remote_rm_url", "--reward.remote_url"])
def test_a_reward_file_is_called_as_openrlhf_calls_it(flag, rl_model, tmp_path):
    reward = write(tmp_path, "reward_func.py", DICT_REWARD)
    label = "--data.label_key" if flag.startswith("--reward.") else "--label_key"
    assert ppo(rl_model, tmp_path / "run", flag, reward, label, "label") == 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 8  # one query a call: 4 prompts x 2 completions, one step
    rows = {row["prompt"]: row["label"] for row in map(json.loads, open(rl_model / "prompts.jsonl"))}
    for call in calls:
        (query,), (prompt,), (label,) = call["queries"], call["prompts"], call["labels"]
        assert query.startswith(prompt) and len(query) > len(prompt)  # the prompt, then the completion
        assert label == rows[prompt]
    assert any(call["queries"][0].endswith("<eos>") for call in calls)  # special tokens kept, as OpenRLHF decodes
    assert read_metrics(tmp_path / "run")[0]["reward"] >= 0


@pytest.mark.parametrize("text", [
    pytest.param(MATH_REWARD, id="math_helpers", marks=pytest.mark.skipif(
        importlib.util.find_spec("math_verify") is None, reason="grade_answer grades with math-verify")),
    pytest.param(TENSOR_REWARD, id="tensor")])
def test_openrlhf_example_reward_files_train(text, rl_model, tmp_path):
    reward = write(tmp_path, "reward_func.py", text)
    assert ppo(rl_model, tmp_path / "run", "--reward.remote_url", reward, "--data.label_key", "label") == 0
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]


def test_a_reward_files_scores_drive_dynamic_filtering_and_its_extra_logs_are_logged(rl_model, tmp_path):
    """OpenRLHF 0.11 drops a group by its reward file's ``scores`` (else its rewards) and logs each ``extra_logs``
    name as a mean over the samples kept (``samples_generator.py``, ``ppo_actor.py``). Every group's rewards here
    are equal, so a filter on them would keep none; its scores all differ, so every group is kept."""
    reward = write(tmp_path, "reward_func.py", SCORED_REWARD)
    assert ppo(rl_model, tmp_path / "run", "--remote_rm_url", reward, "--dynamic_filtering") == 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    (metrics,) = read_metrics(tmp_path / "run")
    assert len(calls) == 8 and metrics["dynamic_filtering/kept_groups"] == 4, metrics
    assert metrics["dynamic_filtering/refill_rounds"] == 0 and metrics["reward"] == 1.0
    assert metrics["reward/score"] == pytest.approx(sum(c["score"] for c in calls) / 8)  # 0..7: 3.5
    assert metrics["reward/extra/query_chars"] == pytest.approx(sum(len(c["queries"][0]) for c in calls) / 8)
    assert metrics["reward/extra/one"] == 1.0


def test_data_max_len_alone_gives_each_completion_what_its_prompt_leaves(rl_model, tmp_path):
    """OpenRLHF 0.11's RL scripts give --data.max_len without --rollout.max_new_tokens: a prompt and its completion
    share it, a completion getting what its prompt leaves (``utils/agent.py``). It used to be refused. The queries
    the reward file gets are prompt + completion: none is longer than 24 tokens, and the budget binds."""
    from openpack.models.loading import load_tokenizer

    reward = write(tmp_path, "reward_func.py", DICT_REWARD)
    assert ppo(rl_model, tmp_path / "run", "--reward.remote_url", reward, "--data.max_len", "24") == 0
    tokenizer = load_tokenizer(str(rl_model / "model"))
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    sizes = [(len(tokenizer(c["prompts"][0], add_special_tokens=False)["input_ids"]),
              len(tokenizer(c["queries"][0], add_special_tokens=False)["input_ids"])) for c in calls]
    assert len(sizes) == 8 and all(prompt < query <= 24 for prompt, query in sizes), sizes
    assert max(query for _, query in sizes) == 24 and max(q - p for p, q in sizes) > 8, sizes  # not COMMON's 8


def test_prorls_stop_properly_penalty_zeroes_the_rewards_of_truncated_completions(rl_model, tmp_path):
    """--reward.stop_properly_penalty_coef 0.0 (OpenRLHF's ProRL v2 script): a completion cut at its 8-token budget
    earns nothing, one that ended on its stop token keeps the file's 1.0; so the mean reward is the share that
    ended. A random policy seldom ends within 8 tokens: some are cut, which is what the test needs."""
    reward = write(tmp_path, "reward_func.py", "def reward_func(queries, prompts, labels):\n    return [1.0]\n")
    assert ppo(rl_model, tmp_path / "run", "--reward.remote_url", reward,
               "--reward.stop_properly_penalty_coef", "0.0") == 0
    (metrics,) = read_metrics(tmp_path / "run")
    assert metrics["response_length/truncated"] > 0, metrics
    assert metrics["reward"] == pytest.approx(1 - metrics["response_length/truncated"]), metrics


@pytest.mark.parametrize("text,expected", [
    (None, "no such file; give OpenRLHF's reward file"),
    ("import not_a_module_anywhere\n", "importing it failed: ModuleNotFoundError"),
    ("def reward(queries, prompts, labels):\n    return [0.0]\n", "the file defines no function reward_func"),
    ("def reward_func(queries):\n    return [0.0]\n", "reward_func(queries) cannot be called as reward_func(queries, "
                                                     "prompts, labels)"),
])
def test_a_reward_file_that_cannot_be_used_is_refused_before_the_run(text, expected, rl_model, tmp_path, capsys,
                                                                     monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the run started before the reward file was checked")

    monkeypatch.setattr(commands, "launch", started)
    path = tmp_path / "reward_func.py"
    if text is not None:
        path.write_text(text)
    assert ppo(rl_model, tmp_path / "run", "--remote_rm_url", str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--remote_rm_url {path}: {expected}" in err, err


def test_a_reward_file_that_answers_the_wrong_type_stops_the_run_naming_it(rl_model, tmp_path, capsys):
    path = write(tmp_path, "reward_func.py", "def reward_func(queries, prompts, labels):\n    return 'good'\n")
    assert ppo(rl_model, tmp_path / "run", "--remote_rm_url", path) == 1
    err = capsys.readouterr().err
    assert f"--remote_rm_url {path}: reward_func returned str 'good' for one query" in err, err
    assert "Traceback" not in err


# An OpenRLHF agent file that keeps the observation reset got (OpenRLHF's: the chat-template-rendered prompt).
SEEN_AGENT = '''
    import json, pathlib
    import torch
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            pass

        async def reset(self, states, **kwargs):
            with open(pathlib.Path(__file__).with_name("observations.jsonl"), "a") as f:
                f.write(json.dumps(states["observation"]) + "\\n")
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            reward = torch.tensor(float(states["action_text"].count("a")))
            return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                    "sampling_params": states.get("sampling_params"), "extra_logs": {}}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)
'''


def test_an_agent_file_gets_chat_prompts_rendered_by_the_chat_template(rl_model, tmp_path):
    prompts = tmp_path / "chat_prompts.jsonl"
    with open(prompts, "w") as f:
        for row in map(json.loads, open(rl_model / "prompts.jsonl")):
            f.write(json.dumps({"messages": [{"role": "user", "content": row["prompt"].strip()}]}) + "\n")
    agent = write(tmp_path, "agent_func.py", SEEN_AGENT)
    argv = ["--actor.model_name_or_path", str(rl_model / "model"), "--data.prompt_dataset", str(prompts),
            "--data.input_key", "messages", "--data.apply_chat_template", "--train.agent_func_path", agent,
            "--ckpt.output_dir", str(tmp_path / "run"), *COMMON]
    assert train_ppo.main(argv) == 0
    seen = [json.loads(line) for line in (tmp_path / "observations.jsonl").read_text().splitlines()]
    assert len(seen) == 8
    assert all(isinstance(o, str) and o.startswith("<bos>user: sort: ") and o.endswith("\nassistant: ")
               for o in seen), seen[:2]
    metrics = read_metrics(tmp_path / "run")[0]
    assert metrics["episodes/done"] == 8 and metrics.get("episodes/error", 0) == 0
