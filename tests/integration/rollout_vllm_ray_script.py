"""Run by test_rollout_vllm_ray.py in its own process: a VLLMEngine as a Ray actor, used, then killed.

Prints one JSON line with what the test checks. A script (not the pytest process) because ``ray.init``
replaces signal handlers and vLLM spawns: both are kept out of the test runner.
"""

import json
import os
import sys
import time

from rollout_models import PROMPTS, perturb, save_demo_policy


def main(model_dir: str) -> None:
    import ray

    from openpack.models.packed import PackedCausalLM
    from openpack.rollout.interface import EngineDiedError
    from openpack.rollout.engine_group import EngineGroup, vllm_engine_actor_class
    from openpack.rollout.interface import SamplingConfig
    from openpack.rollout.weight_sync import InHostSync, policy_weights

    model = save_demo_policy(model_dir)
    os.environ["RAY_worker_niceness"] = "0"  # as openpack's own clusters: Ray's 15 starves the workers under load
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = []
        for in_flight in (True, False):  # one after the other: the first fills vLLM's model-info cache, the second
            # reads it. The first can take weights in flight too (a concurrency group); this group does not ask it to
            actors.append(vllm_engine_actor_class(in_flight, num_cpus=1).remote(model_dir, seed=0, max_model_len=64))
            ray.get(actors[-1].node_and_pid.remote())
        group = EngineGroup(actors, remote=True)
        sampling = SamplingConfig(n=2, max_tokens=6, temperature=1.0)
        completions = group.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])
        sequences = [PROMPTS[0] + [5, 6, 7], PROMPTS[1] + [8, 9], PROMPTS[2] + [10, 11, 12]]
        before = group.score(sequences)
        perturb(model)
        start = time.perf_counter()
        InHostSync(group, bucket_bytes=200_000).push(policy_weights(PackedCausalLM(model), 0), is_main=True)
        sync_s = time.perf_counter() - start
        after = group.score(sequences)
        ray.kill(actors[1])
        try:
            group.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])
            died = None
        except EngineDiedError as error:
            died = str(error)
        versions = partial_rollout(actors[0], model, PackedCausalLM(model))
        print(json.dumps({
            "shape": [len(row) for row in completions],
            "lengths": [len(c.tokens) == len(c.logprobs) for row in completions for c in row],
            "changed": max(abs(a - b) for ra, rb in zip(before, after) for a, b in zip(ra, rb)),
            "sync_s": sync_s,
            "died": died,
            "versions": versions,
        }))
    finally:
        ray.shutdown()


def partial_rollout(actor, model, wrapped) -> list:
    """--partial_rollout with an engine actor: 3 sampling steps, then a pause (in the actor's weights concurrency
    group), the rest of the generation asked for (in its default group: it waits at the step gate), the new weights
    pushed beside it and the engine resumed; each completion's versions. Were a weight call queued behind the
    waiting generation, the push would hang."""
    import ray

    from openpack.rollout.engine_group import EngineGroup
    from openpack.rollout.interface import SamplingConfig
    from openpack.rollout.weight_sync import InHostSync, policy_weights

    group = EngineGroup([actor], remote=True, in_flight=True)
    ray.get(actor.enqueue.remote(PROMPTS, SamplingConfig(max_tokens=8), [5, 6, 7, 8]))
    for _ in range(3):
        ray.get(actor.step.remote())
    group.pause_generation()
    rest = actor.collect.remote()
    perturb(model, seed=2)
    InHostSync(group, bucket_bytes=200_000).push(policy_weights(wrapped, 0), is_main=True)
    group.resume_generation(1)
    return [c.versions for row in ray.get(rest) for c in row]


if __name__ == "__main__":
    main(sys.argv[1])
