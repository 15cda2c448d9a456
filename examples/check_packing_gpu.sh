#!/usr/bin/env bash
# Check, on a GPU node, that packed training forwards are exact with each CUDA backend.
# Record the printed results with the device name and date in docs/verification.md.
set -euo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
openpack check_packing --device cuda --dtype float32
openpack check_packing --device cuda --dtype bfloat16 --attn_backend torch_varlen
if python -c "import flash_attn" 2>/dev/null; then
  openpack check_packing --device cuda --dtype bfloat16 --attn_backend flash_attn
fi
python -m pytest tests/gpu -q
