"""Reward models: a Hugging Face sequence classifier whose value head is read at each packed segment's last token.

A reward model is ``AutoModelForSequenceClassification`` with one label: the
decoder, then a linear head (``score``) from the hidden size to one number.
Here every sequence's last token is found from the segment table
(``core.batch.last_token_index``), so a packed row of many sequences gives
one reward each and padding never enters. Transformers reads the number at
the last token that is not ``pad_token_id``; the same rule applies here, so
the exported model scores exactly as the trainer does (it matters only when
pad == eos: then both read the token before a closing eos, as TRL's
RewardTrainer does). Under ``--ring_attn_size`` the rank holding a segment's
last token reads it and the context group sums the readouts
(``models.context_parallel``), so every rank has every reward::

    input_ids    p0 p1 c0 c1 eos | p0 p1 r0 eos      one pair, packed
    reward read                ^               ^     [r_chosen, r_rejected]

The head is applied to those S hidden states only, never to every token.
``--pretrain`` may be a causal LM (the head is new, initialised as
transformers initialises ``score``: normal with the config's
``initializer_range``, drawn from the seed) or a sequence classifier (its
head is kept). The saved folder is a plain sequence classifier with
``num_labels`` 1; with ``--normalize_reward`` its config also carries
``normalize_reward``, ``reward_mean`` and ``reward_std``, which
``RewardScorer`` applies: ``(reward - mean) / std``.

``--value_head_prefix`` names the head's weights in the saved folder:
``score`` (the default) is what transformers loads; another name (OpenRLHF
saves ``value_head``) is read into ``score`` on load and written back under
that name on export.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from openpack.core.batch import PackedBatch, last_token_index
from openpack.models.context_parallel import last_token_readout, whole_segment_values
from openpack.models.families import check_model_family
from openpack.models.loading import (ModelLoadError, _from_pretrained, load_model_config, prepare_for_training,
                                     quantized)
from openpack.models.packed import packed_forward, padded_forward

HEAD = "score"  # transformers' name for the head of every *ForSequenceClassification


class PackedRewardModel(torch.nn.Module):
    """The module DeepSpeed wraps for reward modelling: ``forward(batch)`` -> one fp32 reward per segment, [S]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch) -> torch.Tensor:
        hidden, head, skip = hidden_states(self.model, batch), getattr(self.model, HEAD), self.model.config.pad_token_id
        if getattr(batch, "context_shard", None) is None:
            return head(hidden[last_token_index(batch, skip)]).float()[:, 0]
        # one rank's part of a split row: the rank holding a segment's last token reads it, the group sums
        index, held = last_token_readout(batch, skip)
        return whole_segment_values(batch, torch.where(held, head(hidden[index]).float()[:, 0], 0.0))


def hidden_states(model, batch) -> torch.Tensor:
    """The decoder's last hidden states of a PackedBatch [T, H], or of a PaddedBatch (the unpacked baseline:
    right-padded rows, attention masked) flattened to [B * L, H]."""
    if isinstance(batch, PackedBatch):
        return packed_forward(model, batch)
    return padded_forward(model, batch).flatten(0, 1)


class PackedValueModel(torch.nn.Module):
    """The critic DeepSpeed wraps for PPO: the reward model's architecture, its head read at every position.

    ``forward(batch)`` returns one fp32 value per position laid out like ``batch.labels`` flattened (as
    ``PackedCausalLM`` lays out log-probs): the value at position t is the critic's estimate before the token
    labelled there (read at ``batch.label_source`` under prefix sharing, where labels sit on their own tokens),
    so the values at a completion's labelled positions are V(s_t) of each of its tokens.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch) -> torch.Tensor:
        hidden = hidden_states(self.model, batch)
        source = getattr(batch, "label_source", None)  # prefix sharing: a label's state is the token before it
        return getattr(self.model, HEAD)(hidden if source is None else hidden[source]).float()[:, 0]


def describe_model(config) -> str:
    """What a model config holds, in words: its architectures and labels (for errors about the wrong kind).

    ``num_labels`` from the loaded config: a saved config.json may hold only ``id2label``, or neither (then
    transformers' default of 2), and the count shown is the one the model would load with."""
    return f"{', '.join(config.architectures or ['no architectures'])} with {config.num_labels} label(s)"


def check_reward_model(pretrain: str, flag: str = "--reward_pretrain") -> None:
    """A folder saved as a one-label sequence classifier (a reward model), else a ModelLoadError naming ``flag``."""
    config = load_model_config(pretrain, flag)
    check_model_family(config, flag)
    heads = [a for a in (config.architectures or []) if a.endswith("ForSequenceClassification")]
    if not heads or config.num_labels != 1:
        raise ModelLoadError(f"{flag} {pretrain}: not a reward model: it is {describe_model(config)}, but a reward "
                             "model is a *ForSequenceClassification with 1 label and a value head; train one with "
                             "openpack train_rm, or pass a causal LM as --pretrain to train_rm for a new head")


def load_reward_model(pretrain: str, bf16: bool = False, gradient_checkpointing: bool = False,
                      value_head_prefix: str = HEAD, pad_token_id: int | None = None, flag: str = "--pretrain",
                      load_in_4bit: bool = False):
    """``AutoModelForSequenceClassification`` with one label and openpack's packed attention.

    A causal LM gets a new head (transformers' initialisation, drawn from the current torch seed); a head saved
    under another ``value_head_prefix`` is read into ``score``. ``pad_token_id`` goes into the config, so the
    exported model scores padded batches in transformers too.
    """
    from transformers import AutoModelForSequenceClassification

    from openpack.models.attention import register_packed_attention

    check_model_family(load_model_config(pretrain, flag), flag)
    seed_state = torch.get_rng_state()  # the new head's draw, redone in fp32 below
    with _HeldReport() as report:  # transformers' load report; shown below unless all it says is expected
        model, info = _from_pretrained(AutoModelForSequenceClassification, pretrain, "reward model", flag,
                                       num_labels=1, attn_implementation=register_packed_attention(),
                                       dtype=torch.bfloat16 if bf16 else torch.float32, output_loading_info=True,
                                       **quantized(load_in_4bit, bf16))
        report.expected = only_a_new_head(info, value_head_prefix)
    head_read = value_head_prefix != HEAD and _load_head(model, Path(pretrain), value_head_prefix, flag)
    if report.expected and info["missing_keys"] and not head_read:
        draw_head_in_fp32(model, seed_state)
        logging.getLogger("openpack").info("%s %s: a causal LM, so the reward model's head (%s) starts new, "
                                           "initialised as transformers initialises it", flag, pretrain, HEAD)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return prepare_for_training(model, gradient_checkpointing)


def draw_head_in_fp32(model, seed_state: torch.Tensor) -> None:
    """A new head is drawn as transformers draws it in fp32 (normal, std ``initializer_range``, the first draw from
    the torch seed the load began with), then cast to the model's dtype: a bf16 reward model starts from the fp32
    one's head rounded, whatever torch's bf16 sampler does. On 2026-11-28 an H200 machine (torch 2.11,
    transformers 5.17) drew another bf16 head from the same seed, which put train_rm's bf16 step-1 loss 0.034 off
    its fp32 loss (docs/verification.md)."""
    head = getattr(model, HEAD)
    if not head.weight.is_floating_point():  # a quantized head keeps transformers' draw
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(seed_state)
        weight = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, model.config.initializer_range)
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.device))
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()


def only_a_new_head(info: dict, value_head_prefix: str = HEAD) -> bool:
    """Whether transformers' loading ``info`` says only what loading a causal LM (or a head saved under
    ``value_head_prefix``) as a reward model means: the head is missing, ``lm_head`` (or that head) unused."""
    return (set(info["missing_keys"]) <= {f"{HEAD}.weight", f"{HEAD}.bias"} and not info["mismatched_keys"] and
            all(key.split(".")[0] in ("lm_head", value_head_prefix) for key in info["unexpected_keys"]))


class _HeldReport(logging.Filter):
    """Holds back transformers' load report while a reward model loads and shows it after, unless ``expected``
    was set: its red "score.weight MISSING" table at every start from a causal LM read as a failure (issue 24).
    A load that raises shows it (transformers' error points at it)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.expected = False
        self.logger = logging.getLogger("transformers.modeling_utils")

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" not in str(record.msg):
            return True
        self.records.append(record)
        return False

    def __enter__(self) -> _HeldReport:
        self.logger.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeFilter(self)
        if not self.expected:
            for record in self.records:
                self.logger.handle(record)


def _load_head(model, folder: Path, prefix: str, flag: str) -> bool:
    """Copy ``<prefix>.weight`` (and bias) of the saved safetensors into the head; absent: keep the new head.
    Returns whether it was found."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            found = {k: weights.get_tensor(k) for k in weights.keys() if k.split(".")[0] == prefix}
        if found:
            head = getattr(model, HEAD)
            try:
                head.load_state_dict({k.split(".", 1)[1]: v for k, v in found.items()})
            except RuntimeError as err:
                raise ModelLoadError(f"{flag} {folder}: the weights under --value_head_prefix {prefix} do not fit "
                                     f"a head of hidden size {head.in_features} to 1 ({err})") from err
            return True
    return False


def normalization(config) -> tuple[float, float] | None:
    """(mean, std) to normalise rewards with, from a saved reward model's config; None when it has none."""
    if not getattr(config, "normalize_reward", False):
        return None
    return float(config.reward_mean), float(config.reward_std)


def set_normalization(config, mean: float, std: float) -> None:
    """Store the training set's reward mean and std in the config (``--normalize_reward``)."""
    config.normalize_reward, config.reward_mean, config.reward_std = True, float(mean), float(std)


def rename_head(folder: Path, prefix: str) -> None:
    """Rewrite a saved folder's head weights from ``score.*`` to ``<prefix>.*`` (OpenRLHF's layout)."""
    from safetensors.torch import load_file, save_file

    for file in Path(folder).glob("*.safetensors"):
        tensors = load_file(str(file))
        if any(k.split(".")[0] == HEAD for k in tensors):
            renamed = {(prefix + k[len(HEAD):] if k.split(".")[0] == HEAD else k): v for k, v in tensors.items()}
            save_file(renamed, str(file), metadata={"format": "pt"})


class RewardScorer:
    """A saved reward model that scores token sequences: packed into rows of at most ``max_tokens`` tokens,
    one reward each, in the order given, normalised when the model's config says so (``--normalize_reward``).

    This is what the standalone ``openpack score`` runs, in one process or in each actor of a Ray group, and
    what an RLHF trainer calls for rewards. Every sequence is its own segment, so the rewards of a batch do
    not depend on how it was packed.
    """

    def __init__(self, pretrain: str, device="cpu", max_tokens: int = 16384, bf16: bool = False,
                 value_head_prefix: str = HEAD, flag: str = "--reward_pretrain"):
        check_reward_model(pretrain, flag)
        self.model = load_reward_model(pretrain, bf16, value_head_prefix=value_head_prefix, flag=flag)
        self.model.to(device).eval()
        self.module, self.device, self.max_tokens = PackedRewardModel(self.model), device, max_tokens
        self.normalization = normalization(self.model.config)

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """One reward per sequence, [N] fp32 on the CPU."""
        from openpack.core.batch import Segment, collate_packed
        from openpack.core.packing import plan_packs

        longest = max((len(s) for s in sequences), default=0)
        if longest > self.max_tokens:
            raise ValueError(f"a sequence of {longest} tokens is longer than a packed row of --max_tokens_per_gpu "
                             f"{self.max_tokens}; raise --max_tokens_per_gpu")
        rewards = torch.zeros(len(sequences))
        for pack in plan_packs([[len(s)] for s in sequences], self.max_tokens).packs:
            batch = collate_packed([Segment(sequences[i], [False] * len(sequences[i]), i) for i in pack])
            rewards[batch.sample_index] = self.module(batch.to(self.device)).cpu()
        if self.normalization is not None:
            mean, std = self.normalization
            rewards = (rewards - mean) / std
        return rewards
