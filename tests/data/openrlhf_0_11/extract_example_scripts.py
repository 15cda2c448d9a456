"""Write ``example_scripts.tsv``: the ``train_ppo_ray`` command line of each of OpenRLHF 0.11.0's RL example scripts.

Usage: ``python extract_example_scripts.py GIT_DIR`` (a clone of github.com/OpenRLHF/OpenRLHF with the tag v0.11.0).
Each script of ``SCRIPTS`` (``examples/scripts/``) is run by bash with ``python3`` and ``ray`` replaced by functions
that print the arguments ``python3 -m openrlhf.cli.train_ppo_ray`` would get (``ray job submit ... -- python3 ...``
runs its command), so bash itself expands the scripts' variables and arrays; nothing else they would start is
called. One line per script: its name and its flags with their values, as a JSON list.

Left out: ``train_ppo_ray_slurm.sh``, whose command runs inside ``srun ... bash -c "..."`` on the cluster (its flags
are those of ``train_ppo_with_reward_fn.sh`` with a reward model instead of a reward file).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = ("train_ppo_ray_hybrid_engine.sh", "train_ppo_with_reward_fn.sh", "train_dapo_ray_hybrid_engine.sh",
           "train_reinforce_baseline_hybrid_engine.sh", "train_reinforce_baseline_ray_agent_async.sh",
           "train_prorlv2_math_hybrid_engine.sh", "train_vlm_math_hybrid_engine.sh")
STUBS = """
python3() { [ "$1" = -m ] && [ "$2" = openrlhf.cli.train_ppo_ray ] && shift 2 && printf '%s\\0' "$@"; }
ray() { while [ $# -gt 0 ] && [ "$1" != -- ]; do shift; done; shift; "$@"; }
"""


def command_line(git_dir: str, script: str) -> list[str]:
    text = subprocess.run(["git", "-C", git_dir, "show", f"HEAD:examples/scripts/{script}"], check=True,
                          capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / script
        path.write_text(STUBS + text)
        out = subprocess.run(["bash", str(path)], check=True, capture_output=True, text=True, cwd=folder).stdout
    return out.split("\0")[:-1]


def main(git_dir: str) -> None:
    lines = ["# script\tflags (JSON): OpenRLHF v0.11.0's examples/scripts/, written by extract_example_scripts.py"]
    for script in SCRIPTS:
        argv = command_line(git_dir, script)
        assert argv and argv[0].startswith("--"), (script, argv[:3])
        lines.append(f"{script}\t{json.dumps(argv)}")
    (Path(__file__).parent / "example_scripts.tsv").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
