"""Test-only: a disk that fills up, in every Python process that has this folder on PYTHONPATH.

With ``OPENPACK_TEST_DISK_FULL_AT`` set, ``torch.save`` to a path containing
that text fails as a full disk does (OSError ENOSPC). Python imports
``sitecustomize`` at startup, so Ray's worker processes, which inherit the
driver's environment on a local cluster, fail the same way. ``torch`` is
patched when something first imports it, so Ray's other processes never
load it.
"""

import errno
import importlib.abc
import importlib.util
import os
import sys

FULL_AT = os.environ.get("OPENPACK_TEST_DISK_FULL_AT")


def _patch(torch) -> None:
    save = torch.save

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and FULL_AT in os.fspath(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(f))
        return save(obj, f, *args, **kwargs)

    torch.save = save_on_a_full_disk


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if FULL_AT:
    sys.meta_path.insert(0, _PatchTorchOnImport())
