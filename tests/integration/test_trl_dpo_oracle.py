"""TRL 1.16's real DPOTrainer as the oracle for openpack's DPO loss and gradient, end to end through the models.

The same tiny Llama pair (policy seed 0, reference seed 1, so every log-ratio
is non-zero), the same 8 plain-text pairs, fp32 on CPU:

* TRL: a real ``DPOTrainer`` (its dataset processing, ``DataCollatorForPreference``,
  fused LM head and ``compute_loss``) on copies of the two models with eager
  attention, one batch holding all 8 pairs in row order; ``loss.backward``.
* openpack: ``tokenize_pairs`` -> ``PreferencePair.segments`` -> the policy
  (openpack's varlen attention) through ``PackedCausalLM`` -> ``pair_logps``
  with a ``ModelReference`` -> ``pair_losses`` -> backward, in three layouts:

  - ``packed``: all 16 segments in one packed row (in a scrambled order, so the
    pairs are found only through the segment table);
  - ``padded``: the same 16 segments right-padded (``--packing_samples`` off);
  - ``split``: two packed micro-batches of 4 pairs, each backpropagating
    ``sum(pair losses) / 8`` with the step's ``sft_tokens_per_pair``,
    gradients accumulated (the step normalisation of ``trainers/dpo.py``).

Each must give TRL's loss (1e-5 absolute) and every parameter's gradient
(atol = rtol = 1e-5). Known, documented differences (``openpack/core/losses.py``)
are kept out of the cases: TRL's DPO ``sigmoid`` ignores ``label_smoothing``
(openpack's applies cDPO), so sigmoid runs with eps = 0; ``aot``/``aot_unpaired``
(batch-sorted) and ``discopop`` are not openpack losses.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import pytest
import torch

from openpack.core.batch import CHOSEN, collate_packed, collate_padded
from openpack.core.losses import PAIR_LOSSES, LossParams, needs_reference, pair_losses
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import Rows
from openpack.data.preference import tokenize_pairs
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.trainers.dpo import pair_logps
from openpack.trainers.reference import ModelReference

MAX_LENGTH = 128  # longer than any sequence below: nothing is truncated on either side
ROWS = [  # characters of the demo tokenizer only; lengths from 5 to 31 tokens a sequence
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
    {"prompt": "07+35=", "chosen": "42", "rejected": "43"},
    {"prompt": "q: what is one plus one\n", "chosen": "two", "rejected": "three"},
    {"prompt": "a b ", "chosen": "c d e f", "rejected": "x"},
    {"prompt": "12+0=", "chosen": "12", "rejected": "123"},  # chosen a prefix of rejected
    {"prompt": "reverse: abcdef\n", "chosen": "fedcba", "rejected": "abcdef"},
    {"prompt": "9-3=", "chosen": "6", "rejected": "-6 or 12 or maybe 7"},
    {"prompt": "+-=: ", "chosen": "=", "rejected": "-"},
]
NUM_PAIRS = len(ROWS)
# 10x Llama's default init: per-token log-probs from -9 to -1 and log-ratios of 0.5 to 9 nats, so beta * h
# reaches the non-linear part of each loss (hinge at beta 0.5 clips some pairs) and the sft token mean of a
# micro-batch differs from the step's. At the default 0.02 the model is near-uniform (every log-prob ~ -ln 46).
INIT_RANGE = 0.2

# id: (loss types, weights, beta, label_smoothing). eps only where TRL reads it (robust, exo_pair).
CASES = {
    "sigmoid": (["sigmoid"], None, 0.1, 0.0),
    "sigmoid-beta0.5": (["sigmoid"], None, 0.5, 0.0),
    "ipo": (["ipo"], None, 0.1, 0.0),
    "ipo-beta0.5": (["ipo"], None, 0.5, 0.0),
    "hinge": (["hinge"], None, 0.1, 0.0),
    "robust": (["robust"], None, 0.1, 0.1),
    "sft": (["sft"], None, 0.1, 0.0),
    "nca_pair": (["nca_pair"], None, 0.1, 0.0),
    "bco_pair": (["bco_pair"], None, 0.1, 0.0),
    "sppo_hard": (["sppo_hard"], None, 0.1, 0.0),
    "apo_zero": (["apo_zero"], None, 0.1, 0.0),
    "apo_down": (["apo_down"], None, 0.1, 0.0),
    "exo_pair": (["exo_pair"], None, 0.1, 0.1),
    "sigmoid_norm": (["sigmoid_norm"], None, 0.1, 0.0),
    "sigmoid+sft": (["sigmoid", "sft"], [1.0, 0.5], 0.1, 0.0),
    "ipo+sft+bco_pair": (["ipo", "sft", "bco_pair"], [0.7, 0.3, 1.2], 0.5, 0.0),
}
LAYOUTS = ("packed", "padded", "split")


@pytest.fixture(scope="module")
def trl_classes():
    pytest.importorskip("trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer
    return Dataset, DPOConfig, DPOTrainer


@pytest.fixture(scope="module")
def setup():
    """Tokenizer, policy != reference (openpack attention), the tokenized pairs and the openpack reference."""
    tok = build_demo_tokenizer()
    policy = tiny_causal_lm("llama", seed=0, vocab_size=len(tok), initializer_range=INIT_RANGE)
    reference = tiny_causal_lm("llama", seed=1, vocab_size=len(tok), initializer_range=INIT_RANGE)
    sources = [f"oracle:{i + 1}" for i in range(NUM_PAIRS)]
    pairs, report = tokenize_pairs(Rows(list(ROWS), sources), tok, max_len=MAX_LENGTH)
    assert len(pairs) == NUM_PAIRS and (report.truncated, report.dropped) == (0, 0)
    segments = [seg for i, pair in enumerate(pairs) for seg in pair.segments(i)]
    chosen_tokens = sum(sum(seg.targets[1:]) for seg in segments if seg.role == CHOSEN)  # as dpo_step counts them
    return dict(
        tok=tok, policy=policy, reference=reference, pairs=pairs, segments=segments,
        ref_scorer=ModelReference(PackedCausalLM(reference), torch.device("cpu")),
        sft_tokens_per_pair=chosen_tokens / NUM_PAIRS,
    )


_TRL_RESULTS: dict = {}  # case -> (loss, grads): one DPOTrainer per case, shared by the three layouts


def trl_loss_and_grads(trl_classes, setup, tmp_path_factory, case: str):
    """TRL's DPOTrainer.compute_loss on one batch of all pairs, and d loss / d policy parameters (cached per case)."""
    cache = _TRL_RESULTS
    if case in cache:
        return cache[case]
    Dataset, DPOConfig, DPOTrainer = trl_classes
    loss_types, weights, beta, eps = CASES[case]
    # Fresh copies for every trainer: DPOTrainer patches forward (its fused LM head) on both models.
    policy, reference = copy.deepcopy(setup["policy"]), copy.deepcopy(setup["reference"])
    for model in (policy, reference):
        model.set_attn_implementation("eager")  # plain HF attention with TRL's padding mask
    args = DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to=[],
        per_device_train_batch_size=NUM_PAIRS, max_length=MAX_LENGTH, dataset_num_proc=None,
        loss_type=list(loss_types), loss_weights=weights, beta=beta, label_smoothing=eps,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(ROWS),
                             processing_class=setup["tok"])
        assert trainer.loss_types == loss_types and trainer.beta == beta and trainer.label_smoothing == eps
        assert not trainer.precompute_ref_logps and trainer.ld_alpha is None and not trainer.use_weighting
        assert trainer.f_divergence_type == "reverse_kl"
        examples = list(trainer.train_dataset)  # row order, none dropped
        batch = trainer.data_collator(examples)
        _assert_same_tokens(batch, setup["segments"])
        policy.train()
        loss = trainer.compute_loss(policy, batch)
    params = dict(policy.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    cache[case] = (loss.detach(), dict(zip(params, grads)))
    return cache[case]


def _assert_same_tokens(batch, segments):
    """TRL's rows [chosen 0..7, rejected 0..7] are openpack's segments, token for token and target for target."""
    by_role = [seg for role in (0, 1) for seg in segments[role::2]]  # segments are [c0, r0, c1, r1, ...]
    assert batch["input_ids"].shape[0] == len(by_role)
    for row, seg in enumerate(by_role):
        n = int(batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, :n].tolist() == list(seg.tokens), row
        assert batch["completion_mask"][row, :n].bool().tolist() == list(seg.targets), row


def _scrambled(segments):
    """A fixed order mixing pairs and roles: the rejected of a pair may come before, or far from, its chosen."""
    order = [5, 12, 0, 15, 3, 8, 10, 1, 14, 6, 2, 9, 13, 4, 11, 7]
    return [segments[i] for i in order]


_OPENPACK_FORWARDS: dict = {}  # layout -> [(PairLogps with the policy's graph, pairs)]: one forward per layout


def openpack_forward(setup, layout: str):
    """The micro-batches of one layout through the policy and the reference: PairLogps per micro-batch."""
    if layout not in _OPENPACK_FORWARDS:
        segments, pad = setup["segments"], setup["tok"].pad_token_id
        if layout == "packed":
            micro_batches = [collate_packed(_scrambled(segments))]
        elif layout == "padded":
            micro_batches = [collate_padded(segments, pad)]
        else:  # two micro-batches of 4 pairs each (a pair is never split)
            half = len(segments) // 2
            micro_batches = [collate_packed(segments[:half]), collate_packed(segments[half:])]
        engine = PackedCausalLM(setup["policy"]).train()
        logps = [pair_logps(batch, engine(batch), setup["ref_scorer"]) for batch in micro_batches]
        assert sum(x.chosen.numel() for x in logps) == NUM_PAIRS
        _OPENPACK_FORWARDS[layout] = logps
    return _OPENPACK_FORWARDS[layout]


def openpack_loss_and_grads(setup, case: str, layout: str):
    """openpack's step loss and d loss / d policy parameters: each micro-batch backpropagates
    sum(pair losses) / (pairs in the step), gradients accumulate (trainers/dpo.py, dpo_step)."""
    loss_types, weights, beta, eps = CASES[case]
    params = LossParams(beta=beta, label_smoothing=eps, sft_tokens_per_pair=setup["sft_tokens_per_pair"])
    names, tensors = zip(*setup["policy"].named_parameters())
    total_loss, total_grads = 0.0, [torch.zeros_like(t) for t in tensors]
    for logps in openpack_forward(setup, layout):
        if not needs_reference(loss_types):  # as PreferenceObjective: no reference for reference-free losses
            logps = dataclasses.replace(logps, ref_chosen=None, ref_rejected=None)
        loss = pair_losses(logps, params, loss_types, weights).sum() / NUM_PAIRS
        grads = torch.autograd.grad(loss, tensors, retain_graph=True)  # the forward is shared by all cases
        total_loss = total_loss + loss.detach()
        total_grads = [a + g for a, g in zip(total_grads, grads)]
    return total_loss, dict(zip(names, total_grads))


def test_cases_cover_every_loss_trl_has():
    """Every openpack loss is checked here except simpo (TRL's CPOTrainer, checked in tests/unit/test_losses.py)."""
    covered = {name for types, *_ in CASES.values() for name in types}
    assert covered == set(PAIR_LOSSES) - {"simpo"}


def test_policy_and_reference_differ(setup):
    """Otherwise every log-ratio is 0 and the losses are the trivial step-1 constants."""
    batch = collate_packed(setup["segments"])
    with torch.no_grad():
        policy = pair_logps(batch, PackedCausalLM(setup["policy"])(batch), setup["ref_scorer"])
    for ratio in (policy.chosen - policy.ref_chosen, policy.rejected - policy.ref_rejected):
        assert ratio.abs().min() > 0.1 and ratio.abs().max() > 2.0, ratio


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_match_trl_dpo_trainer(trl_classes, setup, tmp_path_factory, case, layout):
    trl_loss, trl_grads = trl_loss_and_grads(trl_classes, setup, tmp_path_factory, case)
    loss, grads = openpack_loss_and_grads(setup, case, layout)
    # 1e-5 absolute, plus 1e-6 relative for the large losses: fp32 spacing at sppo_hard's 93 is 7.6e-6, so a few
    # ulps of summation order (TRL sums padded rows, openpack index_adds segments) exceed 1e-5 absolute there.
    tolerance = 1e-5 + 1e-6 * abs(trl_loss.item())
    assert abs(loss.item() - trl_loss.item()) <= tolerance, f"{case}/{layout}: loss {loss.item()} vs TRL {trl_loss.item()}"
    assert grads.keys() == trl_grads.keys()
    assert any(g.abs().max() > 1e-4 for g in trl_grads.values()), "TRL's gradient is zero: nothing compared"
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{case}/{layout}: gradient of {name}: {m}")


def test_sft_tokens_per_pair_matters_when_split(setup):
    """The split layout really tests the step normalisation: with each micro-batch's own tokens per pair
    (sft_tokens_per_pair None) instead of the step's, the sft term is no longer the step's token mean."""
    step, _ = openpack_loss_and_grads(setup, "sft", "split")
    own = sum(pair_losses(x, LossParams(), ["sft"]).sum() / NUM_PAIRS for x in openpack_forward(setup, "split"))
    assert abs(own.item() - step.item()) > 1e-3
