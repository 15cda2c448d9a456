"""Every number two sets of demo runs logged, compared exactly (timings left out): used for issue 25's check
that moving code changed nothing. Usage: python tests/compare_demo_metrics.py RUNS_A RUNS_B, each folder holding
train_sft/ train_dpo/ train_rm/ train_grpo/ train_ppo/ as `openpack <command> --seed 42 --save_path RUNS/<command>`
wrote them. Exits 1 when any number differs."""
import json
import sys
from pathlib import Path


def timing(key: str) -> bool:
    """Wall-clock numbers, which differ between any two runs: time/..., ..._s, ..._per_s."""
    return key.startswith("time/") or key.endswith("_s")


def load(path):
    return [{k: v for k, v in json.loads(line).items() if not timing(k)} for line in open(path)]


failed = False
for cmd in ["train_sft", "train_dpo", "train_rm", "train_grpo", "train_ppo"]:
    a, b = Path(sys.argv[1]) / cmd / "metrics.jsonl", Path(sys.argv[2]) / cmd / "metrics.jsonl"
    ma, mb = load(a), load(b)
    diffs = [(i, k, x.get(k), y.get(k)) for i, (x, y) in enumerate(zip(ma, mb)) for k in set(x) | set(y)
             if x.get(k) != y.get(k)]
    print(cmd, "records", len(ma), len(mb), "numbers compared", sum(len(x) for x in ma), "differing", len(diffs),
          diffs[:5])
    failed = failed or bool(diffs) or len(ma) != len(mb)
sys.exit(1 if failed else 0)
