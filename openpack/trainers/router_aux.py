"""An MoE policy's router load-balancing loss in a training step: each micro-batch's aux loss weighted by its tokens.

transformers' MoE causal LMs add ``router_aux_loss_coef * aux`` to their loss (TRL trains with it when the config
sets ``output_router_logits``; OpenRLHF multiplies it by its own ``--aux_loss_coef``).
Here the policy's forward leaves each micro-batch's aux loss, over its real tokens, on ``PackedCausalLM``
(``router_aux_loss``), and the step's aux loss is the mean of its micro-batches' over every rank, weighted by
their real tokens::

    aux_step = sum_m aux_m * tokens_m / tokens_step        micro-batch m adds coef * aux_m * tokens_m / tokens_step

(times the world size, like the step's other terms, undoing DeepSpeed's mean over ranks). The aux loss multiplies
two means over tokens, so no weighting makes it independent of how a step is cut; weights by tokens count every
token once, as the LM loss does, where OpenRLHF weighs its micro-batches equally (a 20-token micro-batch as much
as a 2000-token one). Under --prefix_sharing a shared prompt's tokens count once, as they are computed once.
A dense model, or a value model, adds and logs nothing.
"""

from __future__ import annotations

import torch


class RouterAux:
    """One step's router aux loss for the model ``engine`` trains: ``names`` is ("router_aux_loss",) for an MoE
    policy, else ().

    ``step_tokens``: the step's real tokens over every rank (``RankStep.real_tokens``), which the micro-batches'
    ``tokens`` add up to.
    """

    def __init__(self, engine, step_tokens: int):
        self.module = getattr(engine, "module", engine)  # DeepSpeed's engine wraps the PackedCausalLM
        self.router = getattr(self.module, "router", None)
        self.step_tokens = step_tokens
        self.names = ("router_aux_loss",) if self.router is not None else ()

    def term(self, tokens: int) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
        """After the forward of a micro-batch of ``tokens`` real tokens: (coef x its weighted aux loss, to add to its
        loss; {name: its weighted aux loss}, for the step's sums). (0.0, {}) for a dense model."""
        if self.router is None:
            return 0.0, {}
        aux, self.module.router_aux_loss = self.module.router_aux_loss, None
        if aux is None:
            raise RuntimeError("an MoE policy's forward left no router aux loss: it ran without gradients")
        share = aux * (tokens / self.step_tokens)
        return self.router.coef * share, {"router_aux_loss": share.detach()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's aux loss (its sums over every rank are the token-weighted mean), or nothing."""
        return {name: sums[name] for name in self.names}
