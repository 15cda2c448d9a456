#!/usr/bin/env bash
# SFT on one node of 8 GPUs through Ray (a local Ray cluster is started when none is running).
set -euo pipefail
openpack train_sft \
    --launcher ray --num_nodes 1 --num_gpus_per_node 8 --num_cpus_per_worker 4 \
    --pretrain Qwen/Qwen2.5-1.5B --dataset /data/sft.jsonl --apply_chat_template \
    --packing_samples --use_dynamic_batch --max_tokens_per_gpu 32768 --max_len 8192 \
    --train_batch_size 128 --learning_rate 1e-5 --bf16 --zero_stage 2 \
    --save_path runs/sft-1.5b --save_steps 500
