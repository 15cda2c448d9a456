"""Multi-turn episodes (issue 27, first part): the token layout, the runner's limits and failures, the environment
protocols (native and OpenRLHF's, without openrlhf installed), chat deltas and the tool loop.

The policy here is a scripted turn function (the engine is not under test: the runner is); where a test needs
one, the tokenizer is the byte-level BPE of conftest, whose decode-then-encode changes ids.
"""

import asyncio
import textwrap

import pytest

from openpack.rl.agents.chat import ChatTemplateError, observation_ids
from openpack.rl.agents.environment import EnvFileError, load_env_file
from openpack.rl.agents.episode import Episode
from openpack.rl.agents.generation import EnginePolicy, episode_rollouts
from openpack.rl.agents.runner import EnvFailureError, Limits, check_failures, episode_metrics, run_episodes
from openpack.rl.agents.tools import ToolEnvironment, load_tools, parse_tool_calls, tool_schemas
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.rollout.interface import Completion

SAMPLE = {"prompt": "2+2=", "label": "4"}


def scripted(turns: list[list[int]]):
    """A policy sampling the given ids turn after turn (log-prob -(turn + 1) for each), recording its contexts."""
    contexts = []

    async def policy(ids, max_tokens, turn=0):
        contexts.append(list(ids))
        tokens = turns[min(len(contexts) - 1, len(turns) - 1)][:max_tokens]
        return Completion(tokens, [-float(len(contexts))] * len(tokens), True)

    policy.contexts = contexts
    return policy


def run(make_env, policy, tokenizer, samples=(SAMPLE,), **limits):
    return asyncio.run(run_episodes(make_env, list(samples), policy, tokenizer, Limits(**limits)))


def write(tmp_path, text, name="env.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


COUNTDOWN = """
    class Countdown:
        async def reset(self, sample):
            self.left = 2
            return sample["prompt"]

        async def step(self, action):
            self.left -= 1
            return {"observation": " again:", "reward": 1.0, "done": self.left == 0, "metrics": {"left": self.left}}
"""


def test_episode_layout_masks_observations_and_credits_turns():
    episode = Episode([1, 2])
    episode.add_action([5, 6], [-0.5, -0.25])
    episode.credit(0.5)
    episode.add_observation([7, 8, 9])
    episode.add_action([10], [-1.0])
    episode.credit(2.0)
    assert episode.tokens == [5, 6, 7, 8, 9, 10]
    assert episode.targets == [True, True, False, False, False, True]
    assert episode.behaviour == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert episode.token_rewards() == [0.0, 0.5, 0.0, 0.0, 0.0, 2.0]
    assert (episode.reward, episode.turns, episode.length) == (2.5, 2, 8)


def test_trained_ids_are_the_sampled_ids(bpe_tok, tmp_path):
    """' 3' sampled as two ids ('Ġ', '3') decodes to text that encodes as one ('Ġ3'): the episode keeps the two."""
    split = bpe_tok.convert_tokens_to_ids(["Ġ", "3"])
    assert bpe_tok(bpe_tok.decode(split))["input_ids"] != split  # the round trip changes ids
    make_env = load_env_file(write(tmp_path, COUNTDOWN))
    policy = scripted([split, split])
    (episode,) = run(make_env, policy, bpe_tok)
    again = bpe_tok(" again:", add_special_tokens=False)["input_ids"]
    assert episode.tokens == split + again + split and episode.stop == "done"
    assert [t for t, target in zip(episode.tokens, episode.targets) if target] == split + split
    assert policy.contexts[1] == episode.prompt + split + again  # turn 2 saw the ids, not re-encoded text
    assert episode.behaviour == [-1.0, -1.0] + [0.0] * len(again) + [-2.0, -2.0]
    assert episode.reward == 2.0 and episode.metrics == {"left": 0.0}


def test_limits_end_episodes_and_are_counted(tmp_path):
    tok = build_demo_tokenizer()
    endless = write(tmp_path, """
        class Endless:
            async def reset(self, sample):
                return sample["prompt"]
            async def step(self, action):
                return ("more", 0.0, False, {})
    """)
    ids = tok("12", add_special_tokens=False)["input_ids"]
    (turns,) = run(load_env_file(endless), scripted([ids]), tok, max_turns=3)
    assert (turns.stop, turns.turns) == ("max_turns", 3)
    (budget,) = run(load_env_file(endless), scripted([ids]), tok, max_tokens=12, max_turns=50)
    assert budget.stop == "token_budget" and budget.length <= 12
    metrics = episode_metrics([turns, budget])
    assert metrics["episodes/max_turns"] == 1 and metrics["episodes/token_budget"] == 1
    assert 0 < metrics["episode_tokens/masked_fraction"] < 1


@pytest.mark.parametrize("body, stop", [
    ("raise RuntimeError('boom')", "error: step 1: RuntimeError: boom"),
    ("await asyncio.Event().wait()", "timeout: step 1 took over 0.01 s"),  # never set: a hang
    ("return 'not a result'", "error: step 1: EnvFileError"),
])
def test_bad_environments_end_their_episode_and_are_counted(body, stop, tmp_path):
    bad = write(tmp_path, f"""
        import asyncio

        class Bad:
            async def reset(self, sample):
                return sample["prompt"]
            async def step(self, action):
                {body}
    """)
    tok = build_demo_tokenizer()
    good = load_env_file(write(tmp_path, COUNTDOWN, "good.py"))
    ids = tok("1", add_special_tokens=False)["input_ids"]
    episodes = run(load_env_file(bad), scripted([ids]), tok, env_timeout_s=0.01) + run(good, scripted([ids]), tok)
    assert episodes[0].failed and episodes[0].stop.startswith(stop), episodes[0].stop
    assert not episodes[1].failed
    assert episode_metrics(episodes)["episodes/" + stop.split(":")[0]] == 1
    check_failures(episodes, 0.5)  # one of two: allowed
    with pytest.raises(EnvFailureError, match="1 of 2 episodes"):
        check_failures(episodes, 0.25)


def test_episodes_run_concurrently(tmp_path):
    """Episode 0's step waits for episode 1's step: run one after the other, episode 0 would time out."""
    path = write(tmp_path, """
        import asyncio

        MET = asyncio.Event()

        class Meet:
            async def reset(self, sample):
                self.first = sample["first"]
                return sample["prompt"]
            async def step(self, action):
                if self.first:
                    await MET.wait()
                else:
                    MET.set()
                return {"observation": None, "reward": 1.0, "done": True}
    """)
    tok = build_demo_tokenizer()
    ids = tok("1", add_special_tokens=False)["input_ids"]
    samples = [{**SAMPLE, "first": True}, {**SAMPLE, "first": False}]
    episodes = run(load_env_file(path), scripted([ids]), tok, samples, env_timeout_s=30)
    assert [e.stop for e in episodes] == ["done", "done"]


OPENRLHF_FILE = """
    import torch

    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.step_idx = 0

        async def reset(self, states: dict, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states: dict, **kwargs):
            done = self.step_idx >= 1
            right = states["label"] in states["action_text"]
            reward = torch.tensor(float(right)) if done else torch.tensor(0.5)
            feedback = "" if done else "\\nuser: try again\\nassistant: "
            self.step_idx += 1
            return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                    "sampling_params": states.get("sampling_params", None),
                    "extra_logs": {"seen": len(states["observation_text"])}}


    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)
"""


def test_an_openrlhf_agent_file_runs_unchanged_without_openrlhf(tmp_path):
    import importlib.util
    import sys

    assert importlib.util.find_spec("openrlhf") is None  # the shim is what the file imports
    tok = build_demo_tokenizer()
    make_env = load_env_file(write(tmp_path, OPENRLHF_FILE), "--agent_func_path")
    assert "openrlhf" not in sys.modules  # removed once the file loaded
    four = tok("4", add_special_tokens=False)["input_ids"]
    (episode,) = run(make_env, scripted([four, four]), tok)
    feedback = tok("\nuser: try again\nassistant: ", add_special_tokens=False)["input_ids"]
    assert episode.tokens == four + feedback + four and episode.stop == "done"
    assert episode.reward == 1.5  # the sum of the turns' rewards, as OpenRLHF sums them
    assert episode.metrics["score"] == 1.0 and episode.metrics["seen"] == len("2+2=4\nuser: try again\nassistant: ")


def test_env_file_errors_name_the_file_and_the_fix(tmp_path):
    two = write(tmp_path, COUNTDOWN + COUNTDOWN.replace("Countdown", "Other"))
    with pytest.raises(EnvFileError, match="exactly one class .*found: Countdown, Other"):
        load_env_file(two)
    with pytest.raises(EnvFileError, match="importing it failed: ZeroDivisionError"):
        load_env_file(write(tmp_path, "x = 1 / 0\n", "broken.py"))
    with pytest.raises(EnvFileError, match="not a Python file"):
        load_env_file(str(tmp_path / "missing.py"))


def test_chat_observations_are_template_deltas(bpe_tok):
    """ChatML: after a sampled <|im_end|>, a tool message is '\\n' (what the template writes after the turn's
    end), the tool turn, then the generation prompt: the ids read as the whole conversation rendered (its own
    encoding may merge across the turns' joins, which is why ids are appended, not re-encoded)."""
    end = bpe_tok.eos_token_id
    action = bpe_tok("4", add_special_tokens=False)["input_ids"] + [end]
    tool = [{"role": "tool", "content": "42"}]
    delta = observation_ids(bpe_tok, tool, action)
    user = [{"role": "user", "content": "hi"}]
    prompt = bpe_tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = bpe_tok.apply_chat_template(user + [{"role": "assistant", "content": "4"}] + tool,
                                        add_generation_prompt=True, tokenize=False)
    assert bpe_tok.decode(list(prompt) + action + delta) == whole


def test_chat_observations_need_a_template():
    tok = build_demo_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="chat template"):
        observation_ids(tok, [{"role": "user", "content": "x"}], [1])


TOOLS = """
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first
            b: the second
        \"\"\"
        return a + b
"""


def test_tool_calls_are_parsed_run_and_counted(tmp_path, bpe_tok):
    tools = load_tools(write(tmp_path, TOOLS, "tools.py"))
    assert [s["function"]["name"] for s in tool_schemas(tools)] == ["add"]
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_tool_calls("<tool_call>{not json</tool_call>") == [] and parse_tool_calls("3") is None
    env = ToolEnvironment(tools)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
    call_ids = bpe_tok(call, add_special_tokens=False)["input_ids"] + [bpe_tok.eos_token_id]
    answer = bpe_tok("42", add_special_tokens=False)["input_ids"] + [bpe_tok.eos_token_id]
    (episode,) = run(lambda: env, scripted([call_ids, answer]), bpe_tok, [{"prompt": "2+40?", "label": "42"}])
    assert (episode.stop, episode.turns, episode.reward) == ("done", 2, 1.0)
    assert episode.metrics == {"tool_calls": 1.0, "tool_failures": 0.0}
    tool_turn = bpe_tok("<|im_start|>tool\n42<|im_end|>", add_special_tokens=False)["input_ids"]
    context = episode.tokens[len(call_ids):-len(answer)]
    assert bpe_tok.decode(context).count("42") == 1 and set(tool_turn) <= set(context)


def test_a_failing_tool_is_an_answer_for_the_model_and_counted(tmp_path):
    env = ToolEnvironment(load_tools(write(tmp_path, TOOLS, "tools.py")))
    result = asyncio.run(env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'))
    assert not result.done and "TypeError" in result.observation[0]["content"]
    result = asyncio.run(env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>'))
    assert "no tool named 'mul'" in result.observation[0]["content"]
    assert result.metrics == {"tool_calls": 2.0, "tool_failures": 2.0}


def test_observation_tokens_are_context_and_get_no_gradient():
    """Hand check on a tiny Llama: the packed episode's loss (its sampled tokens' log-probs, through ``Units`` and
    the packed model) has exactly the gradient of the actions' log-probs computed turn by turn on the plain model;
    had the observation tokens been targets the gradient would differ (the control)."""
    import torch

    from openpack.core.batch import collate_packed
    from openpack.models.packed import PackedCausalLM
    from openpack.models.tiny import tiny_causal_lm
    from openpack.rl.episodes import Units
    from openpack.rl.experience import response_values

    model = tiny_causal_lm("llama")
    episode = Episode([5, 6, 7])
    episode.add_action([8, 9], [-1.0, -1.0])
    episode.add_observation([10, 11, 12])
    episode.add_action([13, 14, 15], [-1.0] * 3)
    rollouts, _ = episode_rollouts([episode], 1, 0)
    units = Units(rollouts, False)
    batch = collate_packed(units.segments(0))
    model.zero_grad()
    logp = response_values(batch, PackedCausalLM(model)(batch))
    assert logp.numel() == 5  # the five sampled tokens, not the observation's three
    logp.sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}

    def by_hand(positions):
        model.zero_grad()
        ids = torch.tensor([episode.prompt + episode.tokens])
        out = model(input_ids=ids, use_cache=False).logits.log_softmax(-1)[0]
        total = sum(out[t - 1, ids[0, t]] for t in positions)
        total.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    actions = [3 + i for i, target in enumerate(episode.targets) if target]
    hand = by_hand(actions)
    for name in hand:
        torch.testing.assert_close(packed[name], hand[name], atol=1e-5, rtol=0, msg=name)
    control = by_hand(range(3, 3 + len(episode.tokens)))
    assert any(not torch.allclose(control[n], hand[n], atol=1e-4) for n in hand)


def test_episodes_become_rollouts_of_their_sampled_ids_and_failed_groups_are_left_out(bpe_tok):
    split = bpe_tok.convert_tokens_to_ids(["Ġ", "3"])  # decodes to " 3", which encodes as one id
    good = Episode([1, 2])
    good.add_action(split, [-0.5, -0.25])
    good.credit(1.0)
    good.add_observation([7])
    good.add_action([4], [-2.0])
    good.credit(0.5)
    good.finished, good.stop = True, "done"
    failed = Episode([1, 2], stop="error: step 1: RuntimeError: down")
    rollouts, dropped = episode_rollouts([good, good, failed, good], 2, version=3)
    assert dropped == 1 and len(rollouts.prompt_tokens) == 2
    assert rollouts.completion_tokens[0] == split + [7, 4]  # the sampled ids as sampled
    assert rollouts.targets[0] == [True, True, False, True]
    assert rollouts.behaviour[0] == [-0.5, -0.25, -2.0]  # targets only
    assert rollouts.turn_credit[0] == [0.0, 1.0, 0.5]
    assert rollouts.env_rewards == [1.5, 1.5] and rollouts.versions == [3, 3]
    assert rollouts.response_lengths() == [3, 3] and rollouts.lengths() == [(6,), (6,)]


def test_per_turn_rewards_are_clipped_like_an_episode_s():
    """--per_turn_reward credits each turn's reward to its last sampled token; --reward_clip_range (by default
    OpenRLHF's -10 10) clips each of them, as it clips an episode's one reward. One episode of 3 sampled tokens,
    turn rewards 4, 25, 3 (REINFORCE, gamma 1): clipped 4, 10, 3, so the returns-to-go are 17, 13, 3 (unclipped
    32, 28, 3), then whitened over the batch's tokens."""
    import torch

    from openpack.core.advantages import whiten
    from openpack.core.rl_losses import PolicyLossParams
    from openpack.rl.episodes import Rollouts
    from openpack.rl.experience import advantages
    from openpack.rl.settings import RLSettings

    rollouts = Rollouts([[1, 2]], [[5, 6, 7]], [[0.0, 0.0, 0.0]], [True], rewards=[32.0], targets=[[True] * 3],
                        env_rewards=[32.0], turn_credit=[[4.0, 25.0, 3.0]])

    def settings(clip):
        return RLSettings(n_samples_per_prompt=1, advantage_estimator="reinforce", loss_agg_mode="token_mean",
                          generate_max_len=8, policy=PolicyLossParams(), kl_coef=0.0, use_kl_loss=False,
                          per_turn_reward=True, reward_clip_range=clip)

    (clipped,), _ = advantages(rollouts, settings((-10.0, 10.0)), None, None)
    (unclipped,), _ = advantages(rollouts, settings(None), None, None)
    torch.testing.assert_close(clipped.double(), whiten(torch.tensor([17.0, 13.0, 3.0])).double())
    torch.testing.assert_close(unclipped.double(), whiten(torch.tensor([32.0, 28.0, 3.0])).double())


def test_turns_waiting_together_go_to_the_engine_in_one_call_per_budget():
    """Turns of different episodes that wait together share an engine call (one per distinct token budget); with
    batching off (HF) each is a call of its own. Results reach the turn that asked."""
    from openpack.rollout.interface import SamplingConfig

    calls = []

    def generate(prompts, sampling, seeds):
        calls.append((len(prompts), sampling.max_tokens, sampling.n))
        return [[Completion([p[-1] + 1] * sampling.max_tokens, [0.0] * sampling.max_tokens, True)] for p in prompts]

    async def many(policy):
        return await asyncio.gather(*(policy([i], 2 + i % 2, i) for i in range(5)))

    for batched, expected in ((True, [(3, 2, 1), (2, 3, 1)]), (False, [(1, 2 + i % 2, 1) for i in range(5)])):
        calls.clear()
        results = asyncio.run(many(EnginePolicy(generate, SamplingConfig(n=4, max_tokens=9), batched)))
        assert [r.tokens for r in results] == [[i + 1] * (2 + i % 2) for i in range(5)]
        assert calls == expected
