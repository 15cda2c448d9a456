"""The held-out evaluation's numbers (issue 42, item 4): pass@k by Chen et al. 2021's unbiased estimator against hand
numbers, a sample's correctness against --eval_pass_threshold, the metric names --best_metric_key may take, and which
evaluation the best checkpoint keeps.

pass@k = 1 - C(n - c, k) / C(n, k) for n samples of which c are correct (1 when n - c < k). By hand:

    n=5, c=2:  k=1: 1 - 3/5 = 0.4      k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
               k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9      k=4: n - c = 3 < 4, so 1
    n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    n=4, c=0: 0 for every k;   n=4, c=4: 1 for every k
"""

import json
import math
from types import SimpleNamespace

import pytest

from openpack.core.pass_at_k import mean_pass_at_k, pass_at_k, reported_ks
from openpack.rl.evaluation import BEST_RECORD, BestPolicy, best_metric_names, episode_metrics, source_metrics


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 2, 3, 0.9), (5, 2, 4, 1.0), (5, 2, 5, 1.0),
    (10, 3, 5, 11 / 12), (4, 0, 1, 0.0), (4, 0, 4, 0.0), (4, 4, 1, 1.0), (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_against_hand_numbers(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_chance_that_k_drawn_samples_hold_a_correct_one():
    """Against the binomial formula itself (exact fractions), for every n <= 12; pass@1 is c / n."""
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_at_k_over_prompts_is_the_mean_and_not_the_max_of_k():
    """Two prompts of 4 samples, 1 and 2 correct: pass@2 = (1 - 3/6 + 1 - 1/6) / 2 = 2/3; taking the best of all 4
    samples (OpenRLHF's "pass@4" read as pass@2) would say 1."""
    correct = [[True, False, False, False], [True, True, False, False]]
    assert mean_pass_at_k(correct, 1) == pytest.approx(3 / 8)
    assert mean_pass_at_k(correct, 2) == pytest.approx(2 / 3)
    assert mean_pass_at_k(correct, 4) == 1.0


def test_the_reported_ks():
    assert reported_ks(1) == [1]
    assert reported_ks(4) == [1, 2, 4]
    assert reported_ks(6) == [1, 2, 4, 6]
    assert reported_ks(16) == [1, 2, 4, 8, 16]


def test_a_sample_is_correct_above_the_threshold():
    """Exact match's 1/0 at the default threshold 0; a continuous reward against 0.3 (0.3 itself fails)."""
    metrics = source_metrics("reward", [1, 0, 0, 0, 1, 1, 0, 0], 4, 0.0)
    assert metrics == pytest.approx({"eval/reward/pass@1": 3 / 8, "eval/reward/pass@2": 2 / 3,
                                     "eval/reward/pass@4": 1.0, "eval/reward/mean_reward": 3 / 8})
    metrics = source_metrics("reward_model_1", [0.5, 0.3, -1.0, 0.31], 2, 0.3)
    assert metrics["eval/reward_model_1/pass@1"] == pytest.approx(0.5)  # 0.5 and 0.31 pass
    assert metrics["eval/reward_model_1/pass@2"] == 1.0
    assert metrics["eval/reward_model_1/mean_reward"] == pytest.approx(0.11 / 4)


def test_failed_episodes_fail_and_the_old_held_out_numbers_stay():
    """Four episodes of one prompt: rewards 1 and 0, one failed (the environment raised), one of reward 0.5."""
    episodes = [SimpleNamespace(failed=False, reward=1.0, turns=2), SimpleNamespace(failed=False, reward=0.0, turns=1),
                SimpleNamespace(failed=True, reward=0.0, turns=0), SimpleNamespace(failed=False, reward=0.5, turns=3)]
    metrics = episode_metrics(episodes, 4, 0.0)
    assert metrics["eval/episode/pass@1"] == pytest.approx(0.5)
    assert metrics["eval/episode/pass@2"] == pytest.approx(1 - 1 / 6)  # two fail of four: C(2,2)/C(4,2)
    assert metrics["eval_success"] == pytest.approx(0.5)  # 2 of the 4 episodes, the failed one among the 4
    assert metrics["eval_reward"] == pytest.approx(0.5) and metrics["eval_turns"] == pytest.approx(2.0)
    assert metrics["eval_failed"] == 1.0 and metrics["eval/episode/mean_reward"] == pytest.approx(0.5)


def test_metric_names_follow_from_the_flags():
    one = SimpleNamespace(reward_pretrain=None, reward_fn="r.py:f")
    assert best_metric_names(1, one, False) == ["eval/reward/pass@1", "eval/reward/mean_reward"]
    models = SimpleNamespace(reward_pretrain=["a", "b"], reward_fn=None)
    assert best_metric_names(2, models, False) == [
        "eval/reward/pass@1", "eval/reward/pass@2", "eval/reward/mean_reward",
        "eval/reward_model_0/pass@1", "eval/reward_model_0/pass@2", "eval/reward_model_0/mean_reward",
        "eval/reward_model_1/pass@1", "eval/reward_model_1/pass@2", "eval/reward_model_1/mean_reward"]
    assert "eval/reward_model_0/pass@1" not in best_metric_names(1, SimpleNamespace(reward_pretrain=["a"],
                                                                                     reward_fn=None), False)
    assert best_metric_names(4, one, True)[-2:] == ["eval_success", "eval_reward"]
    assert "eval/episode/pass@4" in best_metric_names(4, one, True)


def test_the_best_is_the_highest_and_a_tie_keeps_the_earlier(tmp_path):
    """A metric that rises, falls, comes back to its best and falls: only the first two evaluations are kept."""
    best = BestPolicy.of_run("eval/reward/pass@1", tmp_path, "run-a")
    kept = []
    for step, value in enumerate([0.2, 0.5, 0.4, 0.5, 0.1], start=1):
        if best.improves({"eval/reward/pass@1": value}):
            best.value, best.step = value, step
            kept.append(step)
    assert kept == [1, 2] and (best.value, best.step) == (0.5, 2)


def test_a_resumed_run_knows_its_best_and_ignores_another_runs(tmp_path):
    (tmp_path / "best").mkdir()
    record = {"run_id": "run-a", "metric": "eval/reward/pass@1", "value": 0.75, "step": 6}
    (tmp_path / "best" / BEST_RECORD).write_text(json.dumps(record))
    resumed = BestPolicy.of_run("eval/reward/pass@1", tmp_path, "run-a")
    assert (resumed.value, resumed.step) == (0.75, 6)
    assert not resumed.improves({"eval/reward/pass@1": 0.75}) and resumed.improves({"eval/reward/pass@1": 0.8})
    assert BestPolicy.of_run("eval/reward/pass@1", tmp_path, "run-b").value is None  # another run's folder
    assert BestPolicy.of_run("eval/reward/mean_reward", tmp_path, "run-a").value is None  # another metric


def test_an_unknown_key_names_the_logged_ones(tmp_path):
    best = BestPolicy.of_run("eval/reward/pass@8", tmp_path, "run-a")
    with pytest.raises(RuntimeError, match="eval/reward/pass@8 is not among the evaluation's metrics: "
                                           "eval/reward/mean_reward, eval/reward/pass@1"):
        best.improves({"eval/reward/pass@1": 0.5, "eval/reward/mean_reward": 0.1, "loss": 1.0})
