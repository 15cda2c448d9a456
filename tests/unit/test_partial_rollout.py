"""Partial rollouts (issue 42, item 3): each token's sampling version travels from the engine's labels to the loss.

The engine side (vLLM pausing between two sampling steps, behaviour log-probs of both versions checked against
HF forwards) is in tests/integration/test_rollout_vllm.py; here the versions are followed through
``Generator`` -> ``Rollouts`` -> ``Experience`` -> ``train_on`` with an engine that returns known labels, and the
old-version token share the update logs is checked against a hand count.
"""

import pytest
import torch
from test_moe_aux_loss import RecordingEngine

from openpack.core.rl_losses import PolicyLossParams
from openpack.core.schedule import Batching
from openpack.data.prompts import Prompt
from openpack.distributed.process import DistInfo
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.rl.agents.episode import Episode
from openpack.rl.agents.generation import episode_rollouts
from openpack.rl.experience import Scorers, make_experience
from openpack.rl.generation import Generator
from openpack.rl.settings import RLSettings
from openpack.rl.update import train_on
from openpack.rollout.interface import Completion, SamplingConfig

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
ASKED_AT = 2  # the policy version whose weights the batch was asked with
# What the engine returns: per prompt, n = 2 completions as (tokens, its labels). None: a token sampled before a
# weight update landed (the weights the batch was asked with); 3 and 4: two updates landed while it was sampled.
LABELLED = [[([5, 6, 7, 8], [None, None, 3, 3]), ([9, 10], None)],
            [([11, 12, 13], [None, 3, 4]), ([14, 15], [4, 4])]]
SAMPLED_BY = [[2, 2, 3, 3], [2, 2], [2, 3, 4], [4, 4]]


class LabellingEngines:
    """Engines that hand back LABELLED whatever they are asked (the vLLM labels are tested with vLLM)."""

    def start_generate(self, prompts, sampling, seeds):
        return lambda: [[Completion(tokens, [-1.0] * len(tokens), True, versions) for tokens, versions in row]
                        for row in LABELLED]


class TrainingEngine(RecordingEngine):
    def train(self):
        self.module.train()


def rollouts_of_the_batch():
    generator = Generator("vllm", LabellingEngines(), SamplingConfig(n=2), seed=0, chunk=1)
    prompts = [Prompt([1, 2], "p0", {}, "fake"), Prompt([3], "p1", {}, "fake")]
    return generator.rollouts(prompts, step=0, dist=CPU, version=ASKED_AT)


def test_unlabelled_tokens_are_the_asking_versions_and_a_sample_is_as_old_as_its_first_token():
    rollouts = rollouts_of_the_batch()
    assert rollouts.token_versions == SAMPLED_BY
    assert rollouts.versions == [ASKED_AT] * 4
    assert [rollouts.sampled_by(k) for k in range(4)] == SAMPLED_BY
    assert rollouts.select([3, 0]).token_versions == [SAMPLED_BY[3], SAMPLED_BY[0]]


@pytest.mark.parametrize("trained", [4, 3])
def test_the_old_version_token_share_the_update_logs_equals_a_hand_count(trained):
    """Trained at version 4, the tokens an older version sampled are all but the three labelled 4:

        [2, 2, 3, 3] -> 4,  [2, 2] -> 2,  [2, 3, 4] -> 2,  [4, 4] -> 0;   8 of 11 tokens

    and trained at version 3, those labelled 2: 2 + 2 + 1 + 0 = 5 of 11. One optimizer step (train batch 4), so
    the step's share is the batch's. The count is made in the update's loop, per micro-batch, from each token's
    version laid out like its behaviour log-prob."""
    rollouts = rollouts_of_the_batch()
    rollouts.rewards = [1.0, 0.0, 0.0, 1.0]
    settings = RLSettings(n_samples_per_prompt=2, advantage_estimator="group_norm", loss_agg_mode="token_mean",
                          generate_max_len=4, policy=PolicyLossParams(correction="tis", correction_high=2.0),
                          kl_coef=0.0, use_kl_loss=False, train_batch_size=4, packing_samples=True,
                          batching=Batching(max_tokens=64), async_staleness=2)
    experience = make_experience(rollouts, Scorers(), settings, CPU, pad_token_id=0)
    assert [v.tolist() for v in experience.versions] == SAMPLED_BY
    engine = TrainingEngine(PackedCausalLM(tiny_causal_lm("llama", seed=1, vocab_size=32)))
    metrics, _ = train_on(experience, engine, None, settings, CPU, seed=0, version=trained)
    hand = {4: 8, 3: 5}[trained]
    assert metrics["optimizer_steps"] == 1
    assert metrics["async/old_version_tokens"] == pytest.approx(hand / 11, abs=1e-7)


def test_a_synchronous_run_logs_no_old_version_share():
    rollouts = rollouts_of_the_batch()
    rollouts.rewards = [1.0, 0.0, 0.0, 1.0]
    settings = RLSettings(n_samples_per_prompt=2, advantage_estimator="group_norm", loss_agg_mode="token_mean",
                          generate_max_len=4, policy=PolicyLossParams(), kl_coef=0.0, use_kl_loss=False,
                          train_batch_size=4, packing_samples=True, batching=Batching(max_tokens=64))
    experience = make_experience(rollouts, Scorers(), settings, CPU, pad_token_id=0)
    engine = TrainingEngine(PackedCausalLM(tiny_causal_lm("llama", seed=1, vocab_size=32)))
    metrics, _ = train_on(experience, engine, None, settings, CPU, seed=0, version=4)
    assert "async/old_version_tokens" not in metrics


def test_an_episode_keeps_each_sampled_tokens_version_and_none_for_observations():
    """Two turns, a weight update landing inside the first (labels None, 5) and the second sampled by version 6;
    the observation between them is context. Trained tokens only, as the behaviour log-probs: [4, 5, 6]."""
    episode = Episode([1, 2])
    episode.add_action([7, 8], [-0.5, -0.25], [None, 5])
    episode.add_observation([9, 10, 11])
    episode.add_action([12], [-1.0], [6])
    episode.credit(1.0)
    rollouts, dropped = episode_rollouts([episode], n=1, version=4)
    assert dropped == 0
    assert rollouts.token_versions == [[4, 5, 6]] and rollouts.behaviour == [[-0.5, -0.25, -1.0]]
    assert episode.versions == [None, 5, None, None, None, 6]
