"""The demo model cache is keyed by everything that changes the trained model, not by the recipe alone.

A cache keyed only by the demo recipe once let a model trained by older code pass CI on the machine that
held it, while every fresh machine failed (issue 12).
"""

import os
from pathlib import Path

import openpack
from openpack.config import sft
from openpack.trainers import demo

TRAINING_PATH = Path(openpack.__file__).parent / "trainers" / "sft.py"


def test_the_key_changes_with_the_code_on_the_training_path(monkeypatch):
    before = demo.code_key(sft.DEMO_CONFIG)
    assert demo.code_key(sft.DEMO_CONFIG) == before  # deterministic
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes",
                        lambda path: real_read(path) + (b"# edited" if path == TRAINING_PATH else b""))
    assert demo.code_key(sft.DEMO_CONFIG) != before


def test_the_key_changes_with_the_recipe_and_the_library_versions(monkeypatch, tmp_path):
    before = demo.code_key(sft.DEMO_CONFIG)
    recipe = tmp_path / "sft.yaml"
    recipe.write_bytes(sft.DEMO_CONFIG.read_bytes() + b"max_epochs: 7\n")
    assert demo.code_key(recipe) != before
    real_version = demo.importlib.metadata.version
    monkeypatch.setattr(demo.importlib.metadata, "version",
                        lambda name: "9.9" if name == "transformers" else real_version(name))
    assert demo.code_key(sft.DEMO_CONFIG) != before


def test_the_cache_lives_under_openpack_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENPACK_CACHE", str(tmp_path))
    assert demo.cache_root() == tmp_path


def test_tests_run_on_fresh_cache_folders():
    """tests/conftest.py points every cache at a folder made for this session (or at the one `.ci/run` made for
    its run, OPENPACK_TEST_CACHES), never ~/.cache."""
    root = os.environ.get("OPENPACK_TEST_CACHES") or "openpack-test-caches-"
    for variable in ("OPENPACK_CACHE", "HF_HOME", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"):
        assert root in os.environ[variable], variable
        assert not Path(os.environ[variable]).is_relative_to(Path.home() / ".cache"), variable
