"""Rollouts with transformers' ``generate`` on the caller's own model (``--rollout_backend hf``).

For machines without vLLM: the training rank generates with its policy, so there are no weights to sync
(``update_weights`` is a no-op). It is much slower than vLLM (no paged attention or continuous batching),
which is the trade for needing nothing beyond transformers.

Generation is batched and left-padded through the model's normal attention with a KV cache (openpack's
packed attention falls back to plain SDPA when no ``cu_seq_lens`` are given, see ``openpack.models.attention``).
Sampling is seeded from the request seeds inside ``torch.random.fork_rng``, so a call is reproducible and
the trainer's own RNG stream is left untouched; unlike vLLM's per-request seeds, the samples depend on the
whole batch, not on each prompt alone. Log-probs are the log-softmax of the raw logits (``output_logits``),
before temperature and top-p, as the trainer computes them.
"""

from __future__ import annotations

import hashlib

import torch

from openpack.rollout.interface import process_location
from openpack.rollout.interface import Completion, SamplingConfig


class HFEngine:
    """Generate with ``model`` (an HF causal LM, the policy itself). ``synced_gpus=True`` under ZeRO-3,
    where every rank must run the same number of forward passes."""

    def __init__(self, model, pad_token_id: int, eos_token_id: int | None = None, synced_gpus: bool = False):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.synced_gpus = synced_gpus

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]) -> list[list[Completion]]:
        """``sampling.n`` completions of each prompt; ``result[i][j]`` is prompt i's j-th completion.

        Stops on ``sampling.stop_token_ids`` (or on ``eos_token_id`` when that list is empty). Under a shared
        budget (``sampling.max_total``) each completion is cut at its prompt's ``sampling.budget``: generate takes one
        ``max_new_tokens`` for the batch, and a row's tokens up to its budget are what stopping there would give.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
        if not prompts:
            return []
        stops = list(sampling.stop_token_ids) or ([self.eos_token_id] if self.eos_token_id is not None else [])
        input_ids, attention_mask = self._left_padded(prompts)
        budgets = [sampling.budget(len(p)) for p in prompts]
        greedy = sampling.temperature == 0
        sampling_kwargs = {} if greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=self._cuda_devices()):
                torch.manual_seed(combined_seed(seeds))
                output = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, do_sample=not greedy,
                    num_return_sequences=sampling.n, max_new_tokens=max(budgets), min_new_tokens=0,
                    eos_token_id=stops or None, pad_token_id=self.pad_token_id, use_cache=True,
                    return_dict_in_generate=True, output_logits=True, synced_gpus=self.synced_gpus,
                    **sampling_kwargs,
                )
        finally:
            self.model.train(was_training)
        new_tokens = output.sequences[:, input_ids.shape[1]:]
        raw_logprobs = torch.stack(output.logits, dim=1).float().log_softmax(-1)  # [B*n, steps, V]
        chosen = raw_logprobs.gather(-1, new_tokens[..., None])[..., 0]  # [B*n, steps]
        flat = [_completion(row[:budgets[k // sampling.n]].tolist(), lp[:budgets[k // sampling.n]].tolist(), stops)
                for k, (row, lp) in enumerate(zip(new_tokens, chosen))]
        return [flat[i * sampling.n:(i + 1) * sampling.n] for i in range(len(prompts))]

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1 of each sequence (``len(seq) - 1`` values), raw, fp32."""
        results = []
        for seq in sequences:
            ids = torch.tensor([seq], device=self._device())
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            results.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return results

    def update_weights(self, named_tensors) -> None:
        """Nothing to do: this engine generates with the policy itself."""

    def sleep(self) -> None:
        """Nothing to free: the model belongs to the trainer."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """See ``sleep``."""

    def node_and_pid(self) -> str:
        """Where this engine runs, for EngineDiedError."""
        return process_location()

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] input ids left-padded with pad_token_id, and the [B, L] attention mask."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        return ids.to(self._device()), mask.to(self._device())

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _cuda_devices(self) -> list:
        device = self._device()
        return [device] if device.type == "cuda" else []


def combined_seed(seeds: list[int]) -> int:
    """One stable 63-bit seed from the request seeds (Python's hash() is salted for strings, so not that)."""
    return int(hashlib.sha256(repr(list(seeds)).encode()).hexdigest()[:15], 16)


def _completion(tokens: list[int], logprobs: list[float], stops: list[int]) -> Completion:
    """Cut a padded row after its first stop token; ``finished`` when there was one."""
    for t, token in enumerate(tokens):
        if token in stops:
            return Completion(tokens[:t + 1], logprobs[:t + 1], finished=True)
    return Completion(tokens, logprobs, finished=False)
