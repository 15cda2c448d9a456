"""benchmarks/harness.py's peak RSS is the measured process's own, not its parent's.

Linux keeps ``ru_maxrss`` across ``execve``, and Python's subprocess starts a
child by vfork + exec, so a child that reads ``ru_maxrss`` reports its
parent's peak whenever that is the larger; the benchmarks' head timings once
made every DPO run of benchmarks/fused_loss.py report 3426 MiB instead of its
own 1666.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import harness  # noqa: E402


def test_a_child_does_not_inherit_the_parents_peak(tmp_path):
    ballast = torch.ones(128, 1024, 1024)  # 512 MiB resident in this process
    ballast.add_(1)
    script = tmp_path / "small.py"
    script.write_text("x = bytearray(16 << 20)\n")  # the child's own work: 16 MiB
    measured = harness.run_measured([str(script)], tmp_path / "small.log", harness.subprocess_env(1))
    assert measured.returncode == 0
    assert measured.peak_rss_mb < 300, measured  # python alone, plus 16 MiB; not this process's 512+ MiB
    assert measured.peak_rss_mb > 16
    del ballast
