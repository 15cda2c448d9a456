"""Rollout engines for online RL: vLLM actors and an HF ``generate`` fallback, and policy-to-engine weight sync.

Nothing here imports vLLM or Ray at module level; ``VLLMEngine`` imports vLLM when it is constructed.
"""
