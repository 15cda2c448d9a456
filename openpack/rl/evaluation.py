"""Held-out evaluation during online RL (``--eval_prompt_data``; docs/rl.md, "Evaluation during training").

Before training, every ``--eval_steps`` rollout batches and at the end, the engines that generate the rollouts
sample each held-out prompt n times (``--eval_n_samples_per_prompt``, at ``--eval_temperature``), every reward
source scores each sample (single completions) or its environment does (episodes), and pass@1 and pass@k of each
source are logged (``core/pass_at_k.py``, Chen et al. 2021's unbiased estimator). Every evaluation draws with the
same seeds, so two evaluations differ by the weights, not by the draw.

Which weights sample: the current ones. vLLM engines got them in the step's weight sync, which comes before the
evaluation; with ``--async_train`` the next batches were asked for before that sync, and engines run their calls
in order (Ray actors; ``generation.InOrder`` in process), so the evaluation, asked after the sync, samples the
synced weights and leaves the batches in flight as they were. Colocated engines wake and get the weights
(``Colocation``), and HF generation is the policy itself (gathered under ZeRO-3).

``--best_metric_key`` keeps the policy of the evaluation where that metric was highest (after a rollout batch or at
the end; the evaluation before training is the baseline, not a candidate; a tie keeps the earlier) in
``<save_path>/best``: a Hugging Face folder with ``openpack_best.json`` (run id, metric, value, rollout batch), out
of the checkpoints' rotation. A resumed run reads that record, so it knows the best so far.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from openpack.core.pass_at_k import mean_pass_at_k, reported_ks

if TYPE_CHECKING:
    from openpack.data.prompts import Prompt
    from openpack.rl.agents.episode import Episode
    from openpack.rl.agents.generation import AgentGenerator
    from openpack.rl.episodes import Rollouts
    from openpack.rl.generation import Generator
    from openpack.rl.rewards import SourceRewards
    from openpack.rl.step import RLLoop, RolloutBatch
    from openpack.trainers.run import TrainingRun

EPISODE = "episode"  # the source name of an agent run's rewards: its environments'
SEEDS = "eval"  # every evaluation samples with the seeds of this "rollout batch" (``generation.request_seed``)
BEST_DIR, BEST_RECORD = "best", "openpack_best.json"


def source_metric_names(source: str, n: int) -> list[str]:
    """What an evaluation logs of one source with n samples a prompt: pass@k for each reported k, the mean reward."""
    return [*(f"eval/{source}/pass@{k}" for k in reported_ks(n)), f"eval/{source}/mean_reward"]


def best_metric_names(n: int, rl_cfg, agent: bool) -> list[str]:
    """Every metric --best_metric_key may name (higher is better), from the flags alone: checked before any work."""
    from openpack.rl.rewards import source_names

    sources = [EPISODE] if agent else source_names(rl_cfg)
    names = [name for source in sources for name in source_metric_names(source, n)]
    return names + (["eval_success", "eval_reward"] if agent else [])


def source_metrics(source: str, rewards: list[float], n: int, threshold: float) -> dict[str, float]:
    """pass@k (a sample is correct when its reward is above ``threshold``) and the mean reward of one source;
    ``rewards``: n a prompt, prompt-major. A failed episode's reward is ``-inf``: it fails, and no mean counts it."""
    correct = [[r > threshold for r in rewards[i:i + n]] for i in range(0, len(rewards), n)]
    ran = [r for r in rewards if math.isfinite(r)]
    return {**{f"eval/{source}/pass@{k}": mean_pass_at_k(correct, k) for k in reported_ks(n)},
            f"eval/{source}/mean_reward": sum(ran) / len(ran) if ran else 0.0}


def episode_metrics(episodes: list[Episode], n: int, threshold: float) -> dict[str, float]:
    """An agent run's: pass@k of its episodes, and the held-out numbers it logged before pass@k existed
    (``eval_success``: the share of episodes with a reward above 0; failed episodes count as failures)."""
    ran = [e for e in episodes if not e.failed]
    return {**source_metrics(EPISODE, [-math.inf if e.failed else e.reward for e in episodes], n, threshold),
            "eval_success": sum(e.reward > 0 for e in ran) / len(episodes),
            "eval_reward": sum(e.reward for e in ran) / max(len(ran), 1),
            "eval_turns": sum(e.turns for e in ran) / max(len(ran), 1),
            "eval_failed": float(len(episodes) - len(ran))}


def completion_metrics(by_source: dict[str, list[float]], rollouts: Rollouts, n: int,
                       threshold: float) -> dict[str, float]:
    """A single-turn run's: pass@k and the mean reward of each source, and the samples' lengths."""
    lengths = rollouts.response_lengths()
    metrics = {"eval/response_length/mean": sum(lengths) / len(lengths),
               "eval/response_length/truncated": sum(not f for f in rollouts.finished) / len(lengths)}
    for source, rewards in by_source.items():
        metrics.update(source_metrics(source, rewards, n, threshold))
    return metrics


@dataclass
class BestPolicy:
    """--best_metric_key: the best value so far, and where its policy is kept."""

    key: str
    folder: Path  # <save_path>/best
    run_id: str
    value: float | None = None
    step: int | None = None

    @classmethod
    def of_run(cls, key: str, save_path: Path, run_id: str) -> BestPolicy:
        """The best so far of run ``run_id`` (a resumed run's, from its record); none for another run's folder."""
        best = cls(key, Path(save_path) / BEST_DIR, run_id)
        try:
            record = json.loads((best.folder / BEST_RECORD).read_text())
        except (OSError, ValueError):
            return best
        if record.get("run_id") == run_id and record.get("metric") == key:
            best.value, best.step = float(record["value"]), int(record["step"])
        return best

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` beat the best so far (strictly: a tie keeps the earlier policy)."""
        if self.key not in metrics:
            raise RuntimeError(f"--best_metric_key {self.key} is not among the evaluation's metrics: "
                               f"{', '.join(sorted(k for k in metrics if k.startswith('eval')))}")
        return self.value is None or metrics[self.key] > self.value

    def offer(self, run: TrainingRun, step: int, metrics: dict[str, float]) -> bool:
        """Keep the policy of rollout batch ``step`` in ``folder`` when ``metrics`` improve on the best (every rank
        calls it: ZeRO-3 gathers the weights). The folder and its record are replaced together."""
        if not self.improves(metrics):
            return False
        from openpack.distributed.checkpoint import replace_dir, save_hf_model
        from openpack.distributed.process import barrier
        from openpack.distributed.save_path import write_text_atomic

        self.value, self.step = metrics[self.key], step
        staging = self.folder.with_name(f".{self.folder.name}.new")
        save_hf_model(run.engine, run.tokenizer, staging, run.dist.is_main)
        if run.dist.is_main:
            record = {"run_id": self.run_id, "metric": self.key, "value": self.value, "step": step}
            write_text_atomic(staging / BEST_RECORD, json.dumps(record, indent=1) + "\n")
            replace_dir(staging, self.folder)
        barrier()
        return True


@dataclass
class Evaluation:
    """The held-out evaluation of a run, built once by ``run_ppo``."""

    prompts: list[Prompt]
    generator: Generator | AgentGenerator  # the run's engines, sampling the evaluation's way (``with_sampling``)
    rewards: SourceRewards | None  # every source's rewards of single completions; None: episodes score themselves
    n: int  # samples a prompt
    temperature: float
    threshold: float  # a sample is correct above it
    every: int | None = None  # --eval_steps
    best: BestPolicy | None = None

    def __call__(self, loop: RLLoop, when: str, step: int, candidate: bool = True) -> dict[str, float]:
        """Evaluate the current policy (``when``: said on the console), log at rollout batch ``step``, and offer it as
        the best (``candidate``: not the evaluation before training)."""
        metrics = self.measure(loop, step)
        run = loop.run
        run.tracker.message(f"held-out {when}: {self.describe(metrics)}")
        run.tracker.log(step, metrics)
        if self.best is not None and candidate and self.best.offer(run, step, metrics):
            run.tracker.message(f"best {self.best.key} so far: {self.best.value:.4f} at rollout batch {step}; its "
                                f"policy is in {self.best.folder}")
        return metrics

    def measure(self, loop: RLLoop, step: int) -> dict[str, float]:
        """Sample every held-out prompt n times with the current weights and score the samples (every rank alike)."""
        from openpack.rl.step import gathered

        loop.run.engine.eval()
        generator = self.generator
        with gathered(loop), loop.colocation or contextlib.nullcontext():
            if self.rewards is None:
                episodes = generator.episodes(generator.submit(self.prompts, SEEDS, loop.dist, step), loop.dist)
            else:
                rollouts = generator.rollouts(self.prompts, SEEDS, loop.dist, step)
        if self.rewards is None:
            return episode_metrics(episodes, self.n, self.threshold)
        by_source = self.rewards.by_source(self.prompts, rollouts, loop.dist, f"the evaluation at rollout batch {step}")
        return completion_metrics(by_source, rollouts, self.n, self.threshold)

    def describe(self, metrics: dict[str, float]) -> str:
        """One line: each source's pass@k and mean reward (episodes: success and turns, as before pass@k)."""
        how = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"
        ks = sorted({1, self.n})
        if self.rewards is None:
            line = (f"success {metrics['eval_success']:.1%} of {len(self.prompts) * self.n} episodes ({how}), "
                    f"{metrics['eval_turns']:.2f} turns each")
            return line + (f", pass@{self.n} {metrics[f'eval/{EPISODE}/pass@{self.n}']:.1%}" if self.n > 1 else "")
        sources = [k.split("/")[1] for k in metrics if k.endswith("/mean_reward")]
        parts = [f"{source} " + ", ".join(f"pass@{k} {metrics[f'eval/{source}/pass@{k}']:.1%}" for k in ks)
                 + f", mean {metrics[f'eval/{source}/mean_reward']:.3f}" for source in sources]
        return "; ".join(parts) + f" ({len(self.prompts)} prompts x {self.n}, {how})"


def with_evaluation(step: Callable[[RolloutBatch], dict], evaluation: Evaluation, loop: RLLoop,
                    total: int) -> Callable[[RolloutBatch], dict]:
    """``step`` that also evaluates after every --eval_steps rollout batches (not after the last: the evaluation
    after training follows it)."""

    def step_and_evaluate(batch: RolloutBatch) -> dict:
        metrics = step(batch)
        done = batch.index + 1
        if evaluation.every and done % evaluation.every == 0 and done < total:
            evaluation(loop, f"at rollout batch {done}", done)
        return metrics

    return step_and_evaluate
