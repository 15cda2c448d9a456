"""TRL 1.16's real DPOTrainer as the oracle for openpack's DPO loss and gradient, end to end through the models.

The same tiny Llama pair (policy seed 0, reference seed 1, so every log-ratio
is non-zero), the same 8 plain-text pairs, fp32 on CPU:

* TRL: a real ``DPOTrainer`` (its dataset processing, ``DataCollatorForPreference``,
  fused LM head and ``compute_loss``) on copies of the two models with eager
  attention, one batch holding all 8 pairs in row order; its gradient.
* openpack: ``tokenize_pairs`` -> ``PreferencePair.segments`` -> the policy
  (openpack's varlen attention) through ``PackedCausalLM`` -> ``PairTable.logps``
  with a ``ModelReference`` -> ``pair_losses`` -> backward, in three layouts:

  - ``packed``: all 16 segments in one packed row (in a scrambled order, so the
    pairs are found only through the segment table);
  - ``padded``: the same 16 segments right-padded (``--packing_samples`` off);
  - ``split``: two packed micro-batches of 4 pairs, each backpropagating
    ``sum(pair losses) / 8`` with the step's ``sft_tokens_per_pair``,
    gradients accumulated (the step normalisation of ``trainers/dpo.py``).

Each must give TRL's loss (1e-5 absolute) and every parameter's gradient
(atol = rtol = 1e-5), absolute tolerances in units of the loss or gradient
scale where that is above 1 (only sppo_hard needs it; see ``assert_matches_trl``).
Observed: at most 1.6e-6 in loss and 2.1e-6 in gradients for the O(1) losses.
Known, documented differences (``openpack/core/losses.py``)
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
from openpack.core.logprobs import segment_logprobs
from openpack.core.losses import PAIR_LOSSES, LossParams, needs_reference, pair_losses
from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.data.loading import Rows
from openpack.data.preference import tokenize_pairs
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.trainers.dpo import PairTable
from openpack.trainers.reference import ModelReference

MAX_LENGTH = 128  # longer than any sequence below: nothing is truncated on either side
ROWS = [  # characters of the demo tokenizer only; sequences of 6 to 30 tokens
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
    "hinge-beta0.5": (["hinge"], None, 0.5, 0.0),  # 3 of the 8 pairs past the margin: relu's zero side
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
    """Tokenizer, policy != reference (openpack attention), the tokenized pairs, the openpack reference and caches."""
    tok = build_demo_tokenizer()
    policy = tiny_causal_lm("llama", seed=0, vocab_size=len(tok), initializer_range=INIT_RANGE)
    reference = tiny_causal_lm("llama", seed=1, vocab_size=len(tok), initializer_range=INIT_RANGE)
    sources = [f"oracle:{i + 1}" for i in range(NUM_PAIRS)]
    pairs, report = tokenize_pairs(Rows(list(ROWS), sources), tok, max_len=MAX_LENGTH)
    assert len(pairs) == NUM_PAIRS and (report.truncated, report.dropped) == (0, 0)
    segments = [seg for i, pair in enumerate(pairs) for seg in pair.segments(i)]  # [c0, r0, c1, r1, ...]
    chosen_tokens = sum(sum(seg.targets[1:]) for seg in segments if seg.role == CHOSEN)  # as dpo_step counts them
    return {
        "tok": tok, "policy": policy, "reference": reference, "segments": segments,
        "ref_scorer": ModelReference(PackedCausalLM(reference), torch.device("cpu")),
        "sft_tokens_per_pair": chosen_tokens / NUM_PAIRS,
        "trl_results": {},  # case -> (loss, grads): one DPOTrainer per case, shared by the three layouts
        "forwards": {},  # layout -> [PairLogps with the policy's graph]: one forward per layout, shared by the cases
    }


def trl_loss_and_grads(trl_classes, setup, tmp_path_factory, case: str, spec=None):
    """TRL's DPOTrainer.compute_loss on one batch of all pairs, and d loss / d policy parameters (cached per case)."""
    if case in setup["trl_results"]:
        return setup["trl_results"][case]
    Dataset, DPOConfig, DPOTrainer = trl_classes
    loss_types, weights, beta, eps = spec or CASES[case]
    # Fresh copies for every trainer: DPOTrainer patches forward (its fused LM head) on both models.
    policy, reference = copy.deepcopy(setup["policy"]), copy.deepcopy(setup["reference"])
    for model in (policy, reference):
        model.set_attn_implementation("eager")  # plain HF attention with TRL's padding mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to=[],
            per_device_train_batch_size=NUM_PAIRS, max_length=MAX_LENGTH, dataset_num_proc=None,
            loss_type=list(loss_types), loss_weights=weights, beta=beta, label_smoothing=eps,
        )
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(ROWS),
                             processing_class=setup["tok"])
        assert trainer.loss_types == loss_types and trainer.beta == beta and trainer.label_smoothing == eps
        assert not trainer.precompute_ref_logps and trainer.ld_alpha is None and not trainer.use_weighting
        assert trainer.f_divergence_type == "reverse_kl" and not trainer.aux_loss_enabled
        batch = trainer.data_collator(list(trainer.train_dataset))  # all 8 pairs in row order, none dropped
        _assert_same_tokens(batch, setup["segments"])
        policy.train()
        loss = trainer.compute_loss(policy, batch)
    params = dict(policy.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    setup["trl_results"][case] = (loss.detach(), dict(zip(params, grads)))
    return setup["trl_results"][case]


def _assert_same_tokens(batch, segments):
    """TRL's rows [chosen 0..7, rejected 0..7] are openpack's segments, token for token and target for target."""
    by_role = segments[0::2] + segments[1::2]
    assert batch["input_ids"].shape[0] == len(by_role)
    for row, seg in enumerate(by_role):
        n = int(batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, :n].tolist() == list(seg.tokens), row
        assert batch["completion_mask"][row, :n].bool().tolist() == list(seg.targets), row


def _scrambled(segments):
    """A fixed order mixing pairs and roles: a pair's rejected may come before, or far from, its chosen."""
    order = [5, 12, 0, 15, 3, 8, 10, 1, 14, 6, 2, 9, 13, 4, 11, 7]
    return [segments[i] for i in order]


def openpack_forward(setup, layout: str):
    """The micro-batches of one layout through the policy and the reference: PairLogps per micro-batch."""
    if layout not in setup["forwards"]:
        segments, pad = setup["segments"], setup["tok"].pad_token_id
        if layout == "packed":
            micro_batches = [collate_packed(_scrambled(segments))]
        elif layout == "padded":
            micro_batches = [collate_padded(segments, pad)]
        else:  # two packed micro-batches of 4 pairs each (a pair is never split)
            half = len(segments) // 2
            micro_batches = [collate_packed(segments[:half]), collate_packed(segments[half:])]
        engine = PackedCausalLM(setup["policy"]).train()
        logps = [PairTable(batch, "cpu").logps(segment_logprobs(batch, engine(batch)).sum,
                                               setup["ref_scorer"].segment_sums(batch)) for batch in micro_batches]
        assert sum(x.chosen.numel() for x in logps) == NUM_PAIRS
        setup["forwards"][layout] = logps
    return setup["forwards"][layout]


def openpack_loss_and_grads(setup, case: str, layout: str, spec=None):
    """openpack's step loss and d loss / d policy parameters: each micro-batch backpropagates
    sum(pair losses) / (pairs in the step), gradients accumulate (trainers/dpo.py, dpo_step)."""
    loss_types, weights, beta, eps = spec or CASES[case]
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
    (logps,) = openpack_forward(setup, "packed")
    for ratio in (logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected):
        assert ratio.abs().min() > 0.1 and ratio.abs().max() > 2.0, ratio


def assert_matches_trl(loss, grads, trl_loss, trl_grads, what):
    """Loss and every parameter's gradient to 1e-5, in units of their scale where that is above 1.

    For a loss, and gradient entries, up to 1 this is exactly 1e-5 absolute (and rtol 1e-5 for gradients);
    above 1 the absolute tolerance is 1e-5 times the TRL loss, or the parameter's largest TRL gradient
    entry. Only sppo_hard needs that (loss 93, gradient entries up to 48): there fp32's noise floor is
    above a plain 1e-5, since TRL against itself, eager against sdpa attention, differs by 2.3e-5 in the
    loss and 8.6e-5 in the gradient (openpack against TRL: 3.8e-5 and 7.4e-5). Every other case also
    passes a plain 1e-5 (largest: ipo at beta 0.1, 5.7e-6 in the loss and 9.4e-6 in the gradient).
    """
    loss_tol = 1e-5 * max(1.0, abs(trl_loss.item()))
    assert abs(loss.item() - trl_loss.item()) <= loss_tol, f"{what}: loss {loss.item()} vs TRL {trl_loss.item()}"
    assert grads.keys() == trl_grads.keys()
    assert any(g.abs().max() > 1e-4 for g in trl_grads.values()), f"{what}: TRL's gradient is zero, nothing compared"
    for name, grad in grads.items():
        atol = 1e-5 * max(1.0, trl_grads[name].abs().max().item())
        torch.testing.assert_close(grad, trl_grads[name], atol=atol, rtol=1e-5,
                                   msg=lambda m, name=name: f"{what}: gradient of {name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_match_trl_dpo_trainer(trl_classes, setup, tmp_path_factory, case, layout):
    trl_loss, trl_grads = trl_loss_and_grads(trl_classes, setup, tmp_path_factory, case)
    loss, grads = openpack_loss_and_grads(setup, case, layout)
    assert_matches_trl(loss, grads, trl_loss, trl_grads, f"{case}/{layout}")


def test_trl_sigmoid_ignores_label_smoothing(trl_classes, setup, tmp_path_factory):
    """The documented difference, pinned: TRL 1.16's DPO sigmoid with label_smoothing 0.1 is plain DPO
    (openpack's sigmoid at eps 0); openpack's sigmoid at eps 0.1 is cDPO, a different loss."""
    trl_loss, trl_grads = trl_loss_and_grads(trl_classes, setup, tmp_path_factory, "trl-sigmoid-eps0.1",
                                             (["sigmoid"], None, 0.1, 0.1))
    loss, grads = openpack_loss_and_grads(setup, "sigmoid", "packed")
    assert_matches_trl(loss, grads, trl_loss, trl_grads, "sigmoid, TRL eps 0.1 vs openpack eps 0")
    cdpo, _ = openpack_loss_and_grads(setup, "cdpo", "packed", (["sigmoid"], None, 0.1, 0.1))
    assert abs(cdpo.item() - trl_loss.item()) > 1e-3


def test_sft_tokens_per_pair_matters_when_split(setup):
    """The split layout really tests the step normalisation: with each micro-batch's own tokens per pair
    (sft_tokens_per_pair None) instead of the step's, the sft term is no longer the step's token mean."""
    step, _ = openpack_loss_and_grads(setup, "sft", "split")
    own = sum(pair_losses(x, LossParams(), ["sft"]).sum() / NUM_PAIRS for x in openpack_forward(setup, "split"))
    assert abs(own.item() - step.item()) > 1e-3
