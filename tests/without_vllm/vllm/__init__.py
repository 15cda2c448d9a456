"""Stands in front of an installed vLLM for every test not marked ``@pytest.mark.vllm`` (tests/conftest.py).

The test runs as on a machine without vLLM, in its own process and in every process it starts (the CLI, Ray
actors inherit ``PYTHONPATH``): ``--rollout_backend auto`` falls back to HF generation, and a test that needs
vLLM fails here, in CI, instead of on the first machine that lacks it.
"""

raise ImportError(
    "vLLM is hidden from this test: it is not marked @pytest.mark.vllm, so it must pass without vLLM, as it does "
    "on a machine that has none (tests/conftest.py). Mark it @pytest.mark.vllm if it needs vLLM, or "
    "@pytest.mark.vllm(required=False) if it runs either way and should use vLLM where installed."
)
