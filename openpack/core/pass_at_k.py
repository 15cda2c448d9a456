"""pass@k, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1).

With n samples of a prompt of which c are correct, the chance that k of them drawn without replacement hold at
least one correct one is

    pass@k = 1 - C(n - c, k) / C(n, k)          (1 when n - c < k)

and a set of prompts reports the mean over prompts. Taking the best of n samples instead (OpenRLHF 0.11's
"pass@n") is this estimator at k = n only; for k < n the max over the first k samples is an unbiased but noisier
estimate, and the max over all n overestimates pass@k. The product form below avoids the huge binomials
(``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, Chen et al.'s numerically stable version).
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n samples, c of them correct, drawn without replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def reported_ks(n: int) -> list[int]:
    """The k reported for n samples a prompt: 1, 2, 4, ... below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k over prompts: ``correct[p]`` says which of prompt p's n samples are correct (every prompt the same n)."""
    if not correct:
        raise ValueError("pass@k of no prompts")
    return sum(pass_at_k(len(samples), sum(map(bool, samples)), k) for samples in correct) / len(correct)
