"""Statistics of the evaluation: KL divergence per position and paired bootstrap intervals."""

from __future__ import annotations

import numpy as np
import torch


def kl_per_position(ref_logp: torch.Tensor, arm_logp: torch.Tensor) -> np.ndarray:
    """KL(p || q) in nats for each row of log-probabilities ``[positions, vocab]``."""
    p = ref_logp.exp()
    kl = (p * (ref_logp - arm_logp)).sum(-1)
    return kl.clamp_min(0.0).double().numpy()


def summary(kl: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(kl.mean()),
        "median": float(np.median(kl)),
        "p90": float(np.quantile(kl, 0.90)),
        "p99": float(np.quantile(kl, 0.99)),
    }


def bootstrap_ratio(
    arm: np.ndarray,
    base: np.ndarray,
    resamples: int = 2000,
    seed: int = 0,
    clusters: np.ndarray | None = None,
) -> tuple[float, float, float]:
    """Ratio of mean KL ``arm / base`` with a paired 95% bootstrap interval.

    Positions are resampled jointly for both arms (they share references); with ``clusters``
    (a task id per position) whole tasks are resampled instead.
    """
    if arm.shape != base.shape or arm.size == 0:
        raise ValueError("paired bootstrap needs two equally long, non-empty samples")
    rng = np.random.default_rng(seed)
    point = float(arm.mean() / base.mean())
    ratios = np.empty(resamples)
    if clusters is None:
        n = arm.size
        for i in range(resamples):
            idx = rng.integers(0, n, n)
            ratios[i] = arm[idx].sum() / base[idx].sum()
    else:
        ids = np.unique(clusters)
        arm_sum = np.array([arm[clusters == c].sum() for c in ids])
        base_sum = np.array([base[clusters == c].sum() for c in ids])
        for i in range(resamples):
            pick = rng.integers(0, ids.size, ids.size)
            ratios[i] = arm_sum[pick].sum() / base_sum[pick].sum()
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return point, float(lo), float(hi)


def nested_bootstrap_ratio(
    arm: np.ndarray,
    base: np.ndarray,
    outer: np.ndarray,
    inner: np.ndarray,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean-KL ratio with a nested cluster bootstrap: resample outer clusters (haystacks),
    then inner clusters (needles) within each chosen outer cluster, keeping positions paired."""
    if arm.shape != base.shape or arm.size == 0:
        raise ValueError("paired bootstrap needs two equally long, non-empty samples")
    rng = np.random.default_rng(seed)
    point = float(arm.mean() / base.mean())
    groups: dict[int, list[tuple[float, float]]] = {}
    for o in np.unique(outer):
        groups[int(o)] = [
            (
                float(arm[(outer == o) & (inner == i)].sum()),
                float(base[(outer == o) & (inner == i)].sum()),
            )
            for i in np.unique(inner[outer == o])
        ]
    keys = list(groups)
    ratios = np.empty(resamples)
    for r in range(resamples):
        a_sum = b_sum = 0.0
        for o in rng.choice(keys, len(keys)):
            members = groups[int(o)]
            for j in rng.integers(0, len(members), len(members)):
                a_sum += members[j][0]
                b_sum += members[j][1]
        ratios[r] = a_sum / b_sum
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return point, float(lo), float(hi)
