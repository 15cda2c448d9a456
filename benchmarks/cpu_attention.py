"""Packed attention on CPU: openpack's per-length SDPA path vs one padded batched SDPA call vs FlexAttention.

    python benchmarks/cpu_attention.py                 # the four row shapes below, 1 thread, 9 timed calls each
    python benchmarks/cpu_attention.py --smoke         # seconds: tiny rows, 1 timed call (CI)

One attention call of one layer over one packed row, on random q/k/v (fp32, [T, heads, head_dim]):

* ``sdpa per length``: openpack's CPU kernel (``models.attention._sdpa_kernel``): segments of one length are
  stacked into one causal SDPA call, with one gather of the row before and one after. With prefix sharing, the
  two passes of ``_shared_prefix_attention`` (prompt + first completion as one segment, each later completion over
  its prompt's keys and its own).
* ``sdpa padded``: every segment padded to the row's longest, one SDPA call with a causal and key-padding mask
  (what a padded micro-batch computes), gathered in and out of the row.
* ``flex``: ``torch.nn.attention.flex_attention`` compiled (``torch.compile``, inductor's CPU template), one call
  per row with a block mask of the row's documents (or of the prefix tree: a completion sees its prompt and
  itself). The block mask is built once per row outside the timing; its build time and the first call's
  compile time are reported apart. Torch's CPU FlexAttention has no backward (it raises NotImplementedError for
  inputs that require grad), so it is timed on the forward only.

Each arm's output is compared with the per-length path's (max abs difference). Times are medians over
``--repeats`` calls after two warm-up calls, arms interleaved per repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from openpack.core.batch import _shared_prefix
from openpack.models.attention import _sdpa_kernel, _shared_prefix_attention


def shapes(smoke: bool) -> list[dict]:
    """The rows measured: name, segment lengths, query heads, key/value heads, head dim, groups (prefix tree)."""
    g = torch.Generator().manual_seed(0)

    def spread(n, low, high):
        return torch.randint(low, high + 1, (n,), generator=g).tolist()

    if smoke:
        return [dict(name="smoke", lengths=spread(6, 3, 9), heads=2, kv=1, dim=16, groups=None),
                dict(name="smoke, shared", lengths=[12] + spread(3, 2, 5), heads=2, kv=1, dim=16, groups=[4])]
    return [
        # the GRPO demo: 6-token prompts, answers of 3 or 9 tokens (3 distinct lengths), demo model's heads
        dict(name="demo step: 256 x (6 + 3|9)", lengths=[9, 15] * 128, heads=4, kv=4, dim=32, groups=None),
        # grpo_vs_trl.py's random 9.8M model: 128 completions of 1..32 tokens after 6-token prompts, one row
        dict(name="9.8M step: 128 x (6 + 1..32)", lengths=[6 + x for x in spread(128, 1, 32)], heads=4, kv=2,
             dim=96, groups=None),
        # the same in rows no longer than one of TRL's micro-batches (8 x 38 slots)
        dict(name="9.8M small row: 8 x (6 + 1..32)", lengths=[6 + x for x in spread(8, 1, 32)], heads=4, kv=2,
             dim=96, groups=None),
        # long prompts: 4 prompts of 384 tokens x 8 completions of 16..64, unshared and prefix-shared
        dict(name="long: 32 x (384 + 16..64)", lengths=[384 + x for x in spread(32, 16, 64)], heads=4, kv=2, dim=96,
             groups=None),
        dict(name="long, shared: 4 x (384 | 8 x 16..64)", heads=4, kv=2, dim=96, groups=[9] * 4,
             lengths=[v for _ in range(4) for v in [384, *spread(8, 16, 64)]]),
    ]


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def shared_layout(lengths: list[int], groups: list[int]):
    """``core.batch``'s two-pass description of prompt | completion | ... groups (a group's first length is its
    prompt)."""
    starts, prompt_segment, i = [0], [], 0
    for size in groups:
        prompt = i
        for j in range(size):
            prompt_segment.append(-1 if j == 0 else prompt)
            starts.append(starts[-1] + lengths[i])
            i += 1
    return _shared_prefix(starts, prompt_segment)


def visibility(lengths: list[int], groups: list[int] | None):
    """Per token: its segment, and the segment whose keys it may also see (its prompt; itself when none)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    prompt_of = torch.arange(len(lengths))
    if groups:
        i = 0
        for size in groups:
            prompt_of[i + 1:i + size] = i
            i += size
    return segment, prompt_of[segment]


def per_length(q, k, v, row, groups):
    if groups:
        return _shared_prefix_attention("sdpa", q, k, v, row["shared"], None, 0.0, None, row["heads"] // row["kv"])
    return _sdpa_kernel(q, k, v, row["cu"], max(row["lengths"]), None, 0.0, None, row["heads"] // row["kv"])


def padded(q, k, v, row, groups):
    """One SDPA call over every segment padded to the longest (prefix-shared rows: each completion padded with its
    prompt in front, as an unshared padded batch would hold it)."""
    index, mask = row["padded_index"], row["padded_mask"]
    qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [n, H, L, D]
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=row["heads"] != row["kv"])
    out = out.transpose(1, 2)[row["keep"]]  # the rows' own tokens, [tokens, H, D] in padded order
    return out.index_select(0, row["restore_padded"])


def padded_layout(lengths: list[int], groups: list[int] | None):
    """Token index [n, L] of each padded sequence, its [n, 1, L, L] mask, which padded cells are row tokens, and the
    order that puts them back into the row."""
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    sequences, own = [], []  # token positions of each padded sequence; how many trailing ones are its own
    if groups:
        i = 0
        for size in groups:
            prompt = list(range(starts[i], starts[i + 1]))
            sequences.append(prompt + list(range(starts[i + 1], starts[i + 2])))
            own.append(len(sequences[-1]))
            for j in range(i + 2, i + size):
                sequences.append(prompt + list(range(starts[j], starts[j + 1])))
                own.append(starts[j + 1] - starts[j])
            i += size
    else:
        sequences = [list(range(starts[i], starts[i + 1])) for i in range(len(lengths))]
        own = [len(s) for s in sequences]
    width = max(len(s) for s in sequences)
    index = torch.zeros(len(sequences), width, dtype=torch.int64)
    keep = torch.zeros(len(sequences), width, dtype=torch.bool)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for n, (s, mine) in enumerate(zip(sequences, own)):
        index[n, :len(s)] = torch.tensor(s)
        valid[n, :len(s)] = True
        keep[n, len(s) - mine:len(s)] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :])[:, None]
    order = index[keep]
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    return index, mask, keep, restore


def make_flex(row, groups):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    segment, prompt = visibility(row["lengths"], groups)
    T = segment.numel()

    def mask_mod(_b, _h, q_idx, kv_idx):
        own = (segment[q_idx] == segment[kv_idx]) & (kv_idx <= q_idx)
        # a completion's prompt: every key of it (a prompt's own tokens map to themselves: causal only)
        return own | ((segment[kv_idx] == prompt[q_idx]) & (prompt[q_idx] != segment[q_idx])) if groups else own

    start = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, T, T, device="cpu")
    row["flex_mask_s"] = time.perf_counter() - start
    compiled = torch.compile(flex_attention, dynamic=False)

    def call(q, k, v, row, groups):
        out = compiled(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=block_mask,
                       enable_gqa=row["heads"] != row["kv"])
        return out[0].transpose(0, 1)

    return call


def timed(fn, repeats_out: list, backward: bool, q, k, v, row, groups):
    if backward:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        start = time.perf_counter()
        out = fn(q, k, v, row, groups)
        out.backward(row["grad"])
    else:
        with torch.no_grad():
            start = time.perf_counter()
            out = fn(q, k, v, row, groups)
    repeats_out.append(time.perf_counter() - start)
    return out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no_flex", action="store_true", help="skip FlexAttention (its compile takes ~20 s a shape)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 1 if args.smoke else args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32; median of {repeats} calls per "
          "cell after 2 warm-up calls; ms per call of one layer's attention")
    print("| row | tokens | segments (distinct lengths) | pass | sdpa per length | sdpa padded | flex | "
          "padded / per length | flex / per length | max abs diff padded, flex |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    worst = 0.0
    for row in shapes(args.smoke):
        lengths, groups = row["lengths"], row["groups"]
        T = sum(lengths)
        row["cu"] = cu_seqlens(lengths)
        if groups:
            row["shared"] = shared_layout(lengths, groups)
        row["padded_index"], row["padded_mask"], row["keep"], row["restore_padded"] = padded_layout(lengths, groups)
        g = torch.Generator().manual_seed(1)
        q = torch.randn(T, row["heads"], row["dim"], generator=g)
        k, v = (torch.randn(T, row["kv"], row["dim"], generator=g) for _ in range(2))
        row["grad"] = torch.randn(T, row["heads"], row["dim"], generator=g)
        arms = {"sdpa per length": per_length, "sdpa padded": padded}
        if not args.no_flex:
            start = time.perf_counter()
            arms["flex"] = make_flex(row, groups)
            with torch.no_grad():
                arms["flex"](q, k, v, row, groups)
            row["flex_first_s"] = time.perf_counter() - start
        for backward in (False, True):
            names = [a for a in arms if not (backward and a == "flex")]
            times = {a: [] for a in names}
            outputs = {}
            for a in names:  # warm-up
                for _ in range(2):
                    outputs[a] = timed(arms[a], [], backward, q, k, v, row, groups)
            for _ in range(repeats):
                for a in names:
                    timed(arms[a], times[a], backward, q, k, v, row, groups)
            ms = {a: 1e3 * statistics.median(t) for a, t in times.items()}
            ref = outputs["sdpa per length"]
            errors = [(outputs[a] - ref).abs().max().item() for a in names[1:]]
            worst = max(worst, *errors)
            diffs = ", ".join(f"{e:.1e}" for e in errors)
            base = ms["sdpa per length"]
            flex = f"{ms['flex']:.2f}" if "flex" in ms else "no CPU backward" if not args.no_flex else "-"
            flex_ratio = f"{ms['flex'] / base:.2f}x" if "flex" in ms else "-"
            print(f"| {row['name']} | {T} | {len(lengths)} ({len(set(lengths))}) | "
                  f"{'fwd + bwd' if backward else 'fwd'} | {base:.2f} | {ms['sdpa padded']:.2f} | {flex} | "
                  f"{ms['sdpa padded'] / base:.2f}x | {flex_ratio} | {diffs} |")
        if "flex_mask_s" in row:
            print(f"|  {row['name']}: flex block mask built in {row['flex_mask_s']:.2f} s; first call (compile) "
                  f"{row['flex_first_s']:.1f} s | | | | | | | | | |")
    if worst > 1e-4:  # fp32 attention over unit-variance inputs: the arms agree to ~1e-6
        raise SystemExit(f"the arms' outputs differ by up to {worst:.1e}: a layout is wrong")


if __name__ == "__main__":
    main()
