#!/usr/bin/env bash
# The wheels the GPU runbook needs on a lent GPU machine (Python 3.12, manylinux x86-64, no network there), into
# .whl/ (ignored by git), at the versions constraints.txt pins:
#
#   bash examples/gpu_wheels.sh                 # here, once: downloads, builds DeepSpeed's wheel, checks the size
#   # then one call of the device tool, carry [".whl"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site && python3 examples/gpu_runbook.py --out "$OUT"
#
# That machine has torch 2.11 + CUDA 13, transformers 5.17, peft, msgpack, psutil, py-cpuinfo, ninja, einops,
# tqdm, pandas, pyarrow, xxhash, fsspec and huggingface-hub. It lacks:
# - DeepSpeed: the registry has only its source archive, built here into a pure-Python wheel (no ops compiled;
#   openpack steps torch AdamW, and what DeepSpeed compiles just in time there it compiles with nvcc);
# - pydantic (DeepSpeed's config), with pydantic-core, annotated-types and typing-inspection; hjson (DeepSpeed);
# - datasets, dill and multiprocess (openpack's data loading; TRL);
# - trl (the runbook's TRL arm).
# Ray (~70 MB) and vLLM do not fit the 64 MiB a call carries: the runbook uses --launcher local and HF rollouts.
#
# It prints the wheels' total size and fails if the working tree that travels plus the wheels pass 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
LIMIT_MIB=60
pin() {  # the version constraints.txt pins for a package (names compared as pip does: case, '-', '_' alike)
    local want=$(echo "$1" | tr 'A-Z_' 'a-z-')
    local line=$(tr 'A-Z_' 'a-z-' < constraints.txt | grep -E "^${want}==" || true)
    [ -n "$line" ] || { echo "gpu_wheels.sh: $1 is not pinned in constraints.txt" >&2; exit 2; }
    echo "$1==${line#*==}"
}

mkdir -p "$WHEELS"
grep -qx '/.whl/' .gitignore || { echo "gpu_wheels.sh: .gitignore must ignore /.whl/" >&2; exit 2; }
rm -f "$WHEELS"/*.whl

packages=()
for name in trl datasets dill multiprocess pydantic pydantic_core annotated-types typing-inspection hjson; do
    packages+=("$(pin "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "${packages[@]}"

# DeepSpeed's setup.py imports torch, so it builds against this environment's torch (no build isolation, which
# would install a CUDA torch), with every op left to just-in-time builds (DS_BUILD_OPS=0).
python3 -c "import torch" 2>/dev/null || { echo "gpu_wheels.sh: building DeepSpeed's wheel needs torch here" \
    "(pip install torch==2.13.0)" >&2; exit 2; }
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed -w "$WHEELS" \
    "$(pin deepspeed)"

wheels_bytes=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
# What a device call carries besides the wheels: the files git tracks, and the untracked ones it does not ignore.
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
total=$((wheels_bytes + tree_bytes))
ls -1 "$WHEELS"
printf 'wheels: %.1f MiB; working tree: %.1f MiB; together %.1f MiB (limit %d MiB of the 64 a call carries)\n' \
    "$(echo "$wheels_bytes / 1048576" | bc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" \
    "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheels.sh: the working tree and the wheels pass $LIMIT_MIB MiB; a device call carries 64 MiB" >&2
    exit 1
fi
