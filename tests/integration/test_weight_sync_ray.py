"""Weight sync with the traits of real models: tied embeddings, ZeRO-2's flat buffers, the Ray launcher (issue 23).

The default `openpack train_grpo` runs its ranks and its vLLM engine as Ray actors, under ZeRO-2, and most small
open models tie their input and output embeddings. One CPU rank runs ZeRO-2 as DeepSpeed's stage 0 (no flat
buffers), so the ZeRO-2 case runs two ranks (a GPU's ZeRO-2 has the flat buffers on one rank too). Two faults
hid behind tiny untied models run in one process:

- under ZeRO-2 every parameter is a view into one flat buffer, and pickling a view writes its whole storage, so
  each tensor put into Ray's object store carried the whole model (SmolLM2-135M: ~20 GiB for one push);
- a tied model's ``named_parameters()`` has no ``lm_head.weight``, and vLLM's reload keeps the head's own copy
  unless that name is sent: rollouts came from a half-updated policy.

Each run trains at a learning rate that moves the weights (the reward has spread in every group) for 3 steps, so
steps 2 and 3 sample from synced weights: vLLM's log-probs of its own samples must equal the trainer's to 1e-4 in
fp32, and each push may put at most 1.5x the model's bytes into the object store. The same holds for two ranks that
share their rows (``--ring_attn_size 2``): the engine generates whole sequences, and rank 0 alone sends, each
parameter once, whatever ranks train parts of a row.
"""

import json

import pytest
from safetensors.torch import load_file

from openpack.cli import train_grpo

from saved_runs import load_weights, read_metrics

pytestmark = pytest.mark.vllm
pytest.importorskip("ray")

FLAGS = ["--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16", "--max_epochs", "1",
         "--generate_max_len", "8", "--prompt_max_len", "32", "--learning_rate", "1e-3", "--seed", "1",
         "--max_steps", "3", "--rollout_backend", "vllm", "--launcher", "ray",
         "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "256"]
TWO_RANKS = ["--num_gpus_per_node", "2", "--num_cpus_per_worker", "1"]  # ZeRO-2's flat buffers


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, rl_model):
    """``rl_model``'s Llama with its input and output embeddings tied, as SmolLM2's, Qwen2.5's and Llama-3.2's are."""
    from openpack.data.demo_tokenizer import build_demo_tokenizer
    from openpack.models.tiny import tiny_causal_lm

    folder = tmp_path_factory.mktemp("tied") / "model"
    tokenizer = build_demo_tokenizer()
    model = tiny_causal_lm("llama", seed=3, vocab_size=len(tokenizer), hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256,
                           tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def model_bytes(folder) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(f"{folder}/model.safetensors").values())


@pytest.mark.slow
@pytest.mark.parametrize("tied, zero_stage, ranks", [
    (True, "2", TWO_RANKS), (True, "3", ["--num_gpus_per_node", "1"]), (False, "0", ["--num_gpus_per_node", "1"]),
    (True, "2", [*TWO_RANKS, "--ring_attn_size", "2"])],
    ids=["tied-zero2-two-ranks", "tied-zero3", "untied-zero0", "tied-zero2-ring-of-two"])
def test_synced_engine_equals_the_trainer_and_pushes_only_the_model(tied, zero_stage, ranks, tied_model, rl_model,
                                                                   tmp_path):
    model = tied_model if tied else rl_model / "model"
    if tied:
        assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    argv = ["--pretrain", str(model), "--prompt_data", str(rl_model / "prompts.jsonl"),
            "--reward_fn", f"{rl_model / 'reward.py'}:reward", "--save_path", str(tmp_path), "--zero_stage",
            zero_stage, *FLAGS, *ranks]
    assert train_grpo.main(argv) == 0
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    limit = 1.5 * model_bytes(model) / 2**20
    for m in metrics:
        assert m["vllm_logp_diff"] < 1e-4, m  # steps 2 and 3 sample from weights pushed after an update
        assert 0 < m["weight_sync/object_store_mb"] <= limit, (m["weight_sync/object_store_mb"], limit)
    start, end = load_file(f"{model}/model.safetensors"), load_weights(tmp_path)
    moved = max((end[name] - start[name]).abs().max().item() for name in start)
    assert moved > 1e-3  # the policy really moved: a stale weight in the engine would show
