"""On-policy distillation's advantages (``--teacher_pretrain``): each sampled token's advantage gains
``coef x (log nu - log pi)``, the negative k1 reverse KL of the student pi (before the update) to the teacher nu.

Hand numbers, two completions of one prompt [t0 t1 t2 | t3 t4], coef 0.5::

    student logp  [-1.0, -2.0, -0.5 | -3.0, -0.25]
    teacher logp  [-1.5, -1.0, -0.5 | -1.0, -0.75]
    teacher - student   [-0.5, 1.0, 0.0 | 2.0, -0.5]     x 0.5 -> [-0.25, 0.5, 0.0 | 1.0, -0.25]

Alone (every reward 0) the estimators give 0, so those are the advantages; with rewards [1, 0] and dr_grpo
(r - group mean: +0.5, -0.5 on every token of each completion, gamma 1) they are
[0.25, 1.0, 0.5 | 0.5, -0.75]. With a critic the returns stay the task's.

Then the same with real log-probs: a tiny student and teacher score a batch in one packed pass, prefix-shared or
not, and every token's advantage equals coef x (teacher - student) from each completion scored alone in its own row.
"""

import torch

from openpack.core.advantages import distill_advantages
from openpack.core.rl_losses import PolicyLossParams
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.distributed.process import DistInfo
from openpack.models.loading import tokenizer_difference
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.rl.episodes import Rollouts, Units
from openpack.rl.experience import Scorers, advantages, make_experience, response_values
from openpack.core.batch import collate_packed
from openpack.rl.settings import RLSettings

STUDENT = [[-1.0, -2.0, -0.5], [-3.0, -0.25]]
TEACHER = [[-1.5, -1.0, -0.5], [-1.0, -0.75]]
DISTILL = [[-0.25, 0.5, 0.0], [1.0, -0.25]]


def settings(estimator="group_norm", coef=0.5, **kw):
    return RLSettings(2, estimator, "token_mean", 8, PolicyLossParams(), kl_coef=0.0, use_kl_loss=False,
                      distill_coef=coef, **kw)


def hand_batch(rewards):
    return Rollouts([[1, 2], [1, 2]], [[5, 6, 7], [8, 9]], [[0.0] * 3, [0.0] * 2], [True, True],
                    rewards=list(rewards))


def close(actual, expected):
    torch.testing.assert_close(torch.cat(actual), torch.tensor([x for row in expected for x in row]),
                               atol=1e-6, rtol=0)


def test_the_core_term_hand_values():
    student, teacher = torch.tensor(STUDENT[0] + STUDENT[1]), torch.tensor(TEACHER[0] + TEACHER[1])
    close([distill_advantages(student, teacher, 0.5)], DISTILL)


def test_alone_the_advantages_are_the_scaled_reverse_kl_under_every_critic_free_estimator():
    old = {k: torch.tensor(v) for k, v in enumerate(STUDENT)}
    teacher = {k: torch.tensor(v) for k, v in enumerate(TEACHER)}
    for estimator in ("group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"):
        per_token, returns = advantages(hand_batch([0.0, 0.0]), settings(estimator), old, None, None, teacher)
        close(per_token, DISTILL)
        assert returns is None


def test_with_task_rewards_the_term_adds_to_each_tokens_advantage():
    old = {k: torch.tensor(v) for k, v in enumerate(STUDENT)}
    teacher = {k: torch.tensor(v) for k, v in enumerate(TEACHER)}
    per_token, _ = advantages(hand_batch([1.0, 0.0]), settings("dr_grpo"), old, None, None, teacher)
    close(per_token, [[0.25, 1.0, 0.5], [0.5, -0.75]])
    without, _ = advantages(hand_batch([1.0, 0.0]), settings("dr_grpo", coef=0.0), old, None, None, None)
    close(without, [[0.5] * 3, [-0.5] * 2])


def test_with_a_critic_the_returns_stay_the_tasks():
    old = {k: torch.tensor(v) for k, v in enumerate(STUDENT)}
    teacher = {k: torch.tensor(v) for k, v in enumerate(TEACHER)}
    values = {0: torch.tensor([0.1, 0.2, 0.3]), 1: torch.tensor([0.4, 0.5])}
    with_teacher = advantages(hand_batch([1.0, 0.0]), settings("gae"), old, None, values, teacher)
    task = advantages(hand_batch([1.0, 0.0]), settings("gae", coef=0.0), old, None, values, None)
    close(with_teacher[1], [r.tolist() for r in task[1]])
    close(with_teacher[0], [(a + torch.tensor(d)).tolist() for a, d in zip(task[0], DISTILL)])


def tiny(seed):
    torch.manual_seed(seed)
    model = tiny_causal_lm("llama", seed=seed, vocab_size=64, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return PackedCausalLM(model.eval())


def test_packed_and_prefix_shared_passes_give_each_tokens_own_reverse_kl():
    student, teacher = tiny(0), tiny(1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 64, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(3)]
    completions = [torch.randint(3, 64, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(12)]
    rollouts = Rollouts([p for p in prompts for _ in range(4)], completions,
                        [[0.0] * len(c) for c in completions], [True] * 12, rewards=[0.0] * 12)
    with torch.no_grad():  # the oracle: each completion alone in its own row
        alone = [[response_values(b, m(b)) for b in (collate_packed(rollouts.segments(k)) for k in range(12))]
                 for m in (student, teacher)]
    expected = [0.3 * (t - s) for s, t in zip(*alone)]
    dist = DistInfo(0, 1, 0, torch.device("cpu"))
    for shared, cap in ((False, 64), (True, 64), (True, 24)):  # 24 tokens: some groups split into units
        run = settings("group_norm", coef=0.3, prefix_sharing=shared, max_tokens_per_gpu=cap)
        run.n_samples_per_prompt = 4
        experience = make_experience(rollouts, Scorers(old=student, teacher=teacher), run, dist, 0)
        for k in range(12):
            torch.testing.assert_close(experience.advantages[k], expected[k], atol=1e-5, rtol=0)
        reverse_kl = torch.cat([s - t for s, t in zip(*alone)]).mean().item()
        assert abs(experience.metrics("k1")["distill/reverse_kl"] - reverse_kl) < 1e-5


def test_tokenizers_are_told_apart_by_vocabulary_and_special_tokens():
    demo = build_demo_tokenizer()
    assert tokenizer_difference(demo, build_demo_tokenizer()) is None
    assert "vocabularies of 46 and 49 tokens (0 and 3 tokens of one only" in tokenizer_difference(
        demo, build_demo_tokenizer("{}\""))
    other_eos = build_demo_tokenizer()
    other_eos.eos_token = "<unk>"
    assert tokenizer_difference(demo, other_eos) == "eos_token '<eos>' and '<unk>'"
    other_pad = build_demo_tokenizer()
    other_pad.pad_token = "<eos>"  # padding is never scored: no difference
    assert tokenizer_difference(demo, other_pad) is None
