"""A process that trained in-process (one-rank group) can still start openpack subprocesses."""

import os
import subprocess
import sys

from openpack.distributed.process import init_distributed
from hang_guard import HANG_S


def test_a_child_does_not_reuse_the_parents_one_process_rendezvous():
    init_distributed()  # this process's one-rank group holds MASTER_PORT, which children inherit
    code = ("from openpack.distributed.process import init_distributed; "
            "d = init_distributed(); print('ok', d.rank, d.world_size)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S,
                            env={**os.environ}, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok 0 1" in result.stdout
