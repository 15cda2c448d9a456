#!/usr/bin/env bash
# DPO of an 8B model on 2 nodes x 8 GPUs with ZeRO-3, pairs bin-packed into 16k-token rows.
# Run on the Ray head node after `ray start` on both nodes (docs/multinode.md); checkpoints on shared storage.
set -euo pipefail
openpack train_dpo \
    --launcher ray --ray_address auto --num_nodes 2 --num_gpus_per_node 8 --num_cpus_per_worker 8 \
    --pretrain meta-llama/Llama-3.1-8B-Instruct --dataset /shared/data/prefs.jsonl \
    --packing_samples --use_dynamic_batch --max_tokens_per_gpu 16384 --max_len 4096 \
    --train_batch_size 256 --learning_rate 5e-7 --lr_warmup_ratio 0.03 --beta 0.1 --loss_type sigmoid \
    --bf16 --zero_stage 3 --gradient_checkpointing --ref_logps_cache /shared/runs/dpo-8b/ref_logps.pt \
    --save_path /shared/runs/dpo-8b --save_steps 100 --max_ckpt_num 2 --load_checkpoint --use_wandb offline
