"""pytest imports test modules by basename (no packages under tests/), so two files of one name in tests/unit and
tests/integration stop the whole suite's collection ("import file mismatch"): CI failed once on exactly that. A run
of a few files does not notice; this test does, whichever files are run."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_its_own_basename():
    places = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            places[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in places.items() if len(paths) > 1}
    assert not shared, f"rename one of each: {shared}"
