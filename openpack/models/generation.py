"""Greedy completions for evaluation: batched, left-padded, through the unpacked attention path."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Decode each prompt greedily; returns the generated text only, special tokens removed."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outputs = []
    try:
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True).to(device)
            generated = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )
            new_tokens = generated[:, enc["input_ids"].shape[1]:]
            outputs += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return outputs
