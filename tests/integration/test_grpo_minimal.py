"""examples/grpo_minimal.py computes what `openpack train_grpo` computes: the first rollout batch's loss, grad norm,
clip ratio and rewards, with the same seed, data and flags.

The real command runs in this process as a user runs it with ``--launcher local --rollout_backend hf`` (one rank,
DeepSpeed, which runs ZeRO-2 on one CPU rank in fp32 as its stage 0), the minimal file with plain torch. Both
start from the SFT demo model (seed 42, cached: CI's quick start has trained it; elsewhere the first demo test of
a session trains it, minutes: docs/status.md times the SFT demo) on the demo's prompts with its exact-match reward. The
real command gets them as flags (``--label_key response`` is the demo's reward, ``rl/rewards.py``), which skips the
demo's held-out evaluations before and after (1,022 greedy answers each, most of the test's time otherwise).

A rollout batch of 4 prompts x 4 completions is cut into four optimizer steps of 4 completions, each packed into
two rows of at most 32 tokens. The logged loss and grad norm are means over the four steps, so they also depend on
the updates before steps 2-4: AdamW's learning rate, betas and epsilon (with one update, Adam's step is the sign
of the gradient whatever its betas), gradient clipping (``--max_norm`` 0.2 is below the first steps' norms), and
the ratio to the old policy's log-probs with its clipping (the test asserts that some tokens were clipped).

Tolerance: 1e-5 relative. Both sides run the same fp32 ops on the same packed rows (the same planner, forward,
chunked log-probs and loss terms from ``openpack/core``; the same sampled completions, asserted exactly), and
AdamW's single-tensor step is the same in DeepSpeed and torch. The one difference is the clipping coefficient:
DeepSpeed sums the parameters' squared norms where ``clip_grad_norm_`` takes the norm of their norms, and the two
differ in the last bits (0.47433630 against 0.47433624 at step 1). Measured on a 2-core CPU with torch 2.13
(2026-11-28): with DeepSpeed's formula put in the minimal file, every number is equal to the last bit; with
``clip_grad_norm_`` the logged loss differs by 3e-8 and the grad norm by 1.1e-6 relative (the difference grows
through the later AdamW steps, to 1e-5 of step 4's small norm). Each of these changes to the minimal file fails
here (measured, the loss's relative change): the clip range 0.2 -> 0.3 (2.4e-2), dr_grpo's advantages instead of
group_norm's (0.42), torch's default AdamW betas (5.9e-5), no gradient clipping (8.1e-5; 1.0e-2 on the grad norm).
"""

import sys
from pathlib import Path

import pytest

from openpack.cli import train_grpo
from openpack.config.commands import demo_sft_model
from openpack.config.sections import LaunchConfig
from openpack.trainers import demo

from saved_runs import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import grpo_minimal  # noqa: E402

RTOL = 1e-5
SHARED = [  # every flag whose value both sides must agree on, named as both name it
    "--seed", "42", "--max_steps", "1", "--rollout_batch_size", "4", "--n_samples_per_prompt", "4",
    "--micro_rollout_batch_size", "2", "--generate_max_len", "12", "--temperature", "1.0",
    "--advantage_estimator", "group_norm", "--loss_agg_mode", "token_mean", "--eps_clip", "0.2",
    "--train_batch_size", "4", "--max_tokens_per_gpu", "32", "--learning_rate", "2e-4",
    "--adam_betas", "0.9", "0.95", "--adam_epsilon", "1e-8", "--max_norm", "0.2",  # below the first steps' norms
]
REAL_ONLY = [  # what the minimal file does without a flag: one process, HF rollouts, one segment per completion,
    "--launcher", "local", "--rollout_backend", "hf",  # a constant learning rate, no weight decay, no KL term
    "--packing_samples", "--use_dynamic_batch", "--no_prefix_sharing", "--max_epochs", "1", "--top_p", "1.0",
    "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--weight_decay", "0", "--init_kl_coef", "0",
    "--prompt_max_len", "16",  # the demo's: every demo prompt (6 tokens) fits, so none is left out on either side
]


@pytest.fixture(scope="module")
def demo_model():
    """The SFT demo model both sides start from (trained here when the session's cache has none)."""
    return demo_sft_model(LaunchConfig(launcher="local"), 42)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b), 1e-6)


def test_minimal_grpo_equals_the_real_command(demo_model, tmp_path):
    [prompts] = demo.write_prompt_data(tmp_path / "data", is_main=True)  # the demo's prompts, as its run writes them
    demo_task = ["--pretrain", str(demo_model), "--prompt_data", prompts, "--label_key", "response"]
    assert train_grpo.main([*demo_task, *SHARED, *REAL_ONLY, "--save_path", str(tmp_path / "run")]) == 0
    [real] = read_metrics(tmp_path / "run")
    [minimal] = grpo_minimal.main([*SHARED, "--eval_samples", "0"])
    assert real["optimizer_steps"] == minimal["optimizer_steps"] == 4
    assert real["reward"] == minimal["reward"], (real, minimal)  # the same completions were sampled: their rewards
    assert real["response_length/mean"] == minimal["response_length"]  # and lengths agree
    assert 0 < real["reward"] < 1 and real["reward_std"] > 0  # the groups disagree: the advantages are not all 0
    assert real["clip_ratio"] > 0  # in a later step the ratio moved past 1 +- eps_clip for some tokens
    for key in ("loss", "policy_loss", "grad_norm", "clip_ratio"):
        assert close(real[key], minimal[key.replace("policy_", "")]), (key, real, minimal)
