"""Run under torchrun by test_rollout_zero3.py: policy_weights over a ZeRO-3 engine on 2 gloo ranks.

Rank 0 prints one JSON line: whether every streamed tensor equals the unpartitioned model's, the names,
and whether the parameters were partitioned again afterwards. The push goes to a recording engine.
"""

import json

import torch

from openpack.distributed.engine import OptimConfig, ZeroConfig, create_engine
from openpack.distributed.process import init_distributed
from openpack.models.packed import PackedCausalLM
from openpack.models.tiny import tiny_causal_lm
from openpack.rollout.engine_group import EngineGroup
from openpack.rollout.weight_sync import InHostSync, policy_weights

OPTIM = OptimConfig(1e-3, 0.0, (0.9, 0.95), "constant", 0, 10, 0.1, 100.0)


class RecordingEngine:
    """Stands in for a vLLM engine: keeps what it is sent."""

    def __init__(self):
        self.received = []

    def update_weights(self, named_tensors):
        self.received.append([(name, tensor.clone()) for name, tensor in named_tensors])


def main() -> None:
    dist = init_distributed()
    reference = dict(tiny_causal_lm("llama", seed=5, hidden_size=64, num_attention_heads=2).named_parameters())
    model = tiny_causal_lm("llama", seed=5, hidden_size=64, num_attention_heads=2)
    engine = create_engine(PackedCausalLM(model), OPTIM, ZeroConfig(3, False, False, False, param_persistence_threshold=0),
                           dist.world_size)
    recorder = RecordingEngine()
    InHostSync(EngineGroup([recorder], remote=False), bucket_bytes=30_000).push(
        policy_weights(engine.module, zero_stage=3), is_main=dist.rank == 0)
    if dist.rank == 0:
        streamed = [pair for bucket in recorder.received for pair in bucket]
        print(json.dumps({
            "names": [name for name, _ in streamed] == list(reference),
            "equal": all(torch.equal(t, reference[name].detach()) for name, t in streamed),
            "buckets": len(recorder.received),
            "partitioned_after": all(p.numel() == 0 for p in engine.module.parameters()),
        }))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
