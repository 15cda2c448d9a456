"""The RewardTrainer oracle (``trl_reward_oracle.py``) computes what it claims, checked by hand.

For each setting the harness's loss and every gradient must equal a hand computation on the same
token ids, from the causal LM's own base model and the head TRL started from (atol = rtol = 1e-5):

    r(ids)  = score_weight . h[last],  h = base model(ids), last = rightmost index whose id != pad_token_id
    loss_k  = mean_{pairs in micro-batch k} -logsigmoid(r_c - r_r - margin) + c * mean_k((r_c + r_r)^2)
    loss    = sum_k loss_k / K          (K micro-batches of the one optimizer step)

The same file pins the TRL 1.16 behaviours an openpack comparison has to reproduce or avoid: text
concatenation with an appended eos, the reward read before the eos when pad == eos, pairs over
max_length dropped (not truncated), chat-templated rows, the seeded head, the logged metrics.
"""

from __future__ import annotations

import math

import pytest
import torch
from trl_reward_oracle import one_torch_thread, trl_first_step

from openpack.data.demo_tokenizer import build_demo_tokenizer
from openpack.models.tiny import tiny_causal_lm

pytest.importorskip("trl")  # the harness imports it only when called

ROWS = [  # demo-tokenizer characters; 6 to 30 tokens with the eos
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
    {"prompt": "07+35=", "chosen": "42", "rejected": "43"},
    {"prompt": "q: what is one plus one\n", "chosen": "two", "rejected": "three"},
    {"prompt": "a b ", "chosen": "c d e f", "rejected": "x"},
    {"prompt": "12+0=", "chosen": "12", "rejected": "123"},
    {"prompt": "reverse: abcdef\n", "chosen": "fedcba", "rejected": "abcdef"},
    {"prompt": "9-3=", "chosen": "6", "rejected": "-6 or 12 or maybe 7"},
    {"prompt": "+-=: ", "chosen": "=<eos>", "rejected": "-"},  # already ends with eos: TRL adds none
]
MARGINS = [0.5, -0.25, 1.0, 0.0, 2.0, -1.0, 0.75, 0.1]
INIT_RANGE = 0.2  # rewards spread over ~1 (at 0.02 every reward is ~-0.33 and the margins ~0.004)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():  # the hand forwards too (see one_torch_thread)
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_rm_base")
    tok = build_demo_tokenizer()
    model = tiny_causal_lm("llama", seed=3, vocab_size=len(tok), max_position_embeddings=256,
                           initializer_range=INIT_RANGE)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)


def hand_step(base_model, step, pad_id, margins=None, coefficient=None):
    """The loss and gradient of the module docstring, on the harness's ids, with plain autograd."""
    score = step.score_weight.clone().requires_grad_(True)
    names, tensors = zip(*[(f"model.{n}", p) for n, p in base_model.model.named_parameters()])

    def reward(ids):
        last = max(i for i, t in enumerate(ids) if t != pad_id)
        hidden = base_model.model(torch.tensor([ids])).last_hidden_state[0, last]
        return hidden @ score[0]

    loss = 0.0
    for batch in step.micro_batches:
        chosen = torch.stack([reward(step.chosen_ids[i]) for i in batch])
        rejected = torch.stack([reward(step.rejected_ids[i]) for i in batch])
        margin = torch.tensor([margins[step.kept[i]] for i in batch]) if margins else 0.0
        part = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean()
        if coefficient is not None:
            part = part + coefficient * ((chosen + rejected) ** 2).mean()
        loss = loss + part / len(step.micro_batches)
    grads = torch.autograd.grad(loss, [*tensors, score])
    return loss.item(), dict(zip([*names, "score.weight"], grads))


def assert_matches_hand(step, loss, grads):
    assert abs(step.loss - loss) <= 1e-5, (step.loss, loss)
    assert step.grads.keys() == grads.keys()
    assert step.grads["score.weight"].abs().max() > 1e-3  # something was compared
    for name, grad in grads.items():
        torch.testing.assert_close(step.grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def with_margins(rows):
    return [{**row, "score_margin": m} for row, m in zip(rows, MARGINS)]


CASES = {  # id: (margins, center_rewards_coefficient, batch_size)
    "plain": (False, None, None),
    "margin": (True, None, None),
    "center": (False, 0.01, None),
    "margin+center": (True, 0.5, None),
    "accumulated 3+3+2": (True, 0.5, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_hand_computation(model_dir, base_model, case):
    use_margins, coefficient, batch_size = CASES[case]
    rows = with_margins(ROWS) if use_margins else ROWS
    step = trl_first_step(model_dir, rows, margin_key="score_margin" if use_margins else None,
                          center_rewards_coefficient=coefficient, batch_size=batch_size)
    assert step.kept == list(range(len(ROWS)))
    expected = [[0, 1, 2], [3, 4, 5], [6, 7]] if batch_size else [list(range(len(ROWS)))]
    assert step.micro_batches == expected
    loss, grads = hand_step(base_model, step, build_demo_tokenizer().pad_token_id,
                            MARGINS if use_margins else None, coefficient)
    assert_matches_hand(step, loss, grads)


def test_accumulation_averages_micro_batch_means(model_dir):
    """TRL divides each micro-batch's mean by the number of micro-batches: with 3+3+2 pairs the last two
    pairs weigh 3/2 as much as the others, so the step loss is not the mean over the 8 pairs."""
    step = trl_first_step(model_dir, ROWS, batch_size=3)
    losses = -torch.nn.functional.logsigmoid(step.rewards_chosen - step.rewards_rejected)
    mean_of_means = sum(losses[b].mean() for b in step.micro_batches).item() / 3
    assert abs(step.loss - mean_of_means) <= 1e-6
    assert abs(step.loss - losses.mean().item()) > 1e-3


def test_plain_text_is_prompt_chosen_eos_as_text(model_dir):
    """ids = tokenizer(prompt + chosen + eos_token): one eos, never two; no bos (the demo tokenizer adds none)."""
    tok = build_demo_tokenizer()
    step = trl_first_step(model_dir, ROWS)
    for row, chosen, rejected in zip(ROWS, step.chosen_ids, step.rejected_ids):
        for completion, ids in ((row["chosen"], chosen), (row["rejected"], rejected)):
            text = row["prompt"] + completion.removesuffix(tok.eos_token)
            assert ids == tok(text)["input_ids"] + [tok.eos_token_id]


def test_tokenizer_special_tokens_wrap_the_whole_text(model_dir, base_model):
    """tokenizer(text) adds the tokenizer's own special tokens around prompt + chosen + eos: a Llama-style
    bos, and, for a tokenizer that also appends eos, a second eos after the one TRL wrote (no dedupe)."""
    from tokenizers.processors import TemplateProcessing

    tok = build_demo_tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", tok.bos_token_id), ("<eos>", tok.eos_token_id)])
    step = trl_first_step(model_dir, ROWS, tokenizer=tok)
    for row, chosen in zip(ROWS, step.chosen_ids):
        text = row["prompt"] + row["chosen"].removesuffix(tok.eos_token)
        assert chosen == [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id,
                          tok.eos_token_id]
    assert_matches_hand(step, *hand_step(base_model, step, tok.pad_token_id))


def test_implicit_prompt_rows(model_dir, base_model):
    """{"chosen", "rejected"} rows (the prompt inside both texts) are tokenized the same way."""
    tok = build_demo_tokenizer()
    rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in ROWS]
    explicit = trl_first_step(model_dir, ROWS)
    implicit = trl_first_step(model_dir, rows)
    assert implicit.token_ids == explicit.token_ids
    assert_matches_hand(implicit, *hand_step(base_model, implicit, tok.pad_token_id))


def test_pad_equal_to_eos_reads_the_reward_before_the_eos(model_dir, base_model):
    """With pad == eos the appended eos counts as padding for *ForSequenceClassification, so the reward
    is the score of the last text token; the eos is still fed (attention mask 1) but nothing reads it."""
    tok = build_demo_tokenizer()
    tok.pad_token = tok.eos_token
    step = trl_first_step(model_dir, ROWS, tokenizer=tok)
    assert all(ids[-1] == tok.eos_token_id for ids in step.chosen_ids + step.rejected_ids)
    assert_matches_hand(step, *hand_step(base_model, step, tok.eos_token_id))
    apart = build_demo_tokenizer()  # pad != eos: the reward is read at the eos itself
    at_eos = trl_first_step(model_dir, ROWS, tokenizer=apart)
    assert at_eos.token_ids == step.token_ids
    assert (at_eos.rewards_chosen - step.rewards_chosen).abs().min() > 1e-3


def test_pairs_over_max_length_are_dropped_not_truncated(model_dir, base_model):
    """A pair is dropped when either sequence (eos included) is longer than max_length; the kept pairs
    form the micro-batches (here 2+2+1 of the 5 kept), each with its own row's margin."""
    full = trl_first_step(model_dir, ROWS)
    step = trl_first_step(model_dir, with_margins(ROWS), margin_key="score_margin", max_length=12, batch_size=2,
                          center_rewards_coefficient=0.1)
    expected = [i for i, (c, r) in enumerate(full.token_ids) if max(len(c), len(r)) <= 12]
    assert step.kept == expected and len(expected) == 5
    assert step.token_ids == [full.token_ids[i] for i in expected]  # the kept pairs, whole
    assert step.micro_batches == [[0, 1], [2, 3], [4]]
    assert_matches_hand(step, *hand_step(base_model, step, build_demo_tokenizer().pad_token_id, MARGINS, 0.1))


def test_conversational_rows_use_the_chat_template_and_no_extra_eos(model_dir, base_model):
    """Conversational rows: ids = apply_chat_template(prompt + chosen messages); TRL appends no eos itself."""
    tok = build_demo_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].removesuffix(tok.eos_token)}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in ROWS]
    step = trl_first_step(model_dir, rows)
    for row, chosen in zip(rows, step.chosen_ids):
        assert chosen == tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True, return_dict=True)[
            "input_ids"]
        assert chosen[0] == tok.bos_token_id and chosen[-1] == tok.eos_token_id and chosen[-2] != tok.eos_token_id
    assert_matches_hand(step, *hand_step(base_model, step, tok.pad_token_id))


def test_score_head_is_seeded_normal(model_dir, base_model):
    """The new head is set_seed(seed) then normal_(0, initializer_range) on a (1, hidden) tensor: its first draws."""
    hidden = base_model.config.hidden_size
    for seed in (42, 7):
        torch.manual_seed(seed)
        expected = torch.empty(1, hidden).normal_(0.0, INIT_RANGE)
        step = trl_first_step(model_dir, ROWS[:2], seed=seed)
        torch.testing.assert_close(step.score_weight, expected, atol=0, rtol=0)
    given = torch.linspace(-1, 1, hidden)[None]
    assert torch.equal(trl_first_step(model_dir, ROWS[:2], score_weight=given).score_weight, given)


def test_logged_metrics(model_dir):
    """One micro-batch: accuracy = mean(r_c > r_r), margin = mean(r_c - r_r) (the margin column not
    subtracted), min/mean/max over all 2n rewards, num_tokens = every unpadded token fed."""
    step = trl_first_step(model_dir, with_margins(ROWS), margin_key="score_margin")
    rc, rr = step.rewards_chosen, step.rewards_rejected
    both = torch.cat([rc, rr])
    expected = {"accuracy": (rc > rr).float().mean(), "margin": (rc - rr).mean(), "min_reward": both.min(),
                "mean_reward": both.mean(), "max_reward": both.max()}
    for key, value in expected.items():
        assert math.isclose(step.metrics[key], value.item(), abs_tol=1e-6), key
    assert 0 < step.metrics["accuracy"] < 1
    assert step.metrics["num_tokens"] == sum(len(c) + len(r) for c, r in step.token_ids)
