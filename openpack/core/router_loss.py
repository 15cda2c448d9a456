"""The MoE router's load-balancing loss over real tokens only, so a packed row and padded rows give one number.

Switch Transformer's auxiliary loss (arXiv 2101.03961, eqs. 4-6), as transformers' MoE causal LMs compute it
(``load_balancing_loss_func``, one function copied into Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS...): over the tokens
of every MoE layer together, ``E * sum_e f_e * P_e``, with ``f_e`` the share of top-k choices that went to expert
``e`` and ``P_e`` its mean router probability. A balanced router scores k; one that sends every token to the same
experts scores E.

It multiplies two means over tokens, so it is not a sum over tokens: a value depends on which tokens were averaged
together, and the trainers weight micro-batches by their tokens (``trainers/router_aux.py``). The softmax runs in
fp32, as the routers' own does before their top-k; transformers' runs in the logits' dtype (the same in fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The aux loss, a 0-dim fp32 tensor, differentiable through the router probabilities.

    ``router_logits``: one [N, E] tensor per MoE layer (N = B * L tokens, flattened as the decoder's routers see
    them); ``mask``: [B, L], 1 on real tokens, or None when every token is real (a packed row).
    """
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    weight = None if mask is None else mask.reshape(-1, 1).to(device, torch.float32)  # [N, 1]
    tokens = 0.0
    for logits in router_logits:  # one layer at a time: [N, E] at most, as transformers does
        probabilities = torch.softmax(logits.reshape(-1, num_experts), dim=-1, dtype=torch.float32)
        chosen = torch.zeros_like(probabilities).scatter_(1, probabilities.topk(top_k, dim=-1).indices, 1.0)
        if weight is not None:
            chosen, probabilities = chosen * weight, probabilities * weight
        counts = counts + chosen.sum(0)
        probability_sums = probability_sums + probabilities.sum(0)
        tokens = tokens + (probabilities.shape[0] if weight is None else weight.sum())
    return num_experts * torch.sum(counts / tokens * probability_sums / tokens)
