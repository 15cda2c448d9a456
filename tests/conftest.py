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

