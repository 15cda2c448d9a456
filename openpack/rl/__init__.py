"""Online RL (PPO, GRPO, REINFORCE++, RLOO): the loop that samples, rewards and learns, on packed experience.

Read it in this order:

1. ``step.py``        what one RL step does: generate -> reward -> (filter) -> experience -> update -> weight sync
2. ``generation.py``  where completions come from: vLLM engines or the policy itself (``rollout/`` holds the
                      engines); ``pipeline.py``: how far ahead of training they are generated (``--async_train``)
3. ``rewards.py``     where rewards come from: a function, a server, reward models or exact match; shared, shaped
4. ``experience.py``  how experience is packed and scored: old, reference and critic log-probs, advantages
5. ``update.py``      how the update is made: planned packed steps, the policy's and the critic's losses

Beside them: ``episodes.py`` (the rollout batch every module passes along), ``settings.py`` (what the step needs
of the flags), ``colocation.py`` (``--colocate_all_models``: engines and trainers take turns on the devices) and
``worker.py`` (one rank's set-up, then ``run.train`` over the steps: what ``openpack train_ppo`` runs).
"""
