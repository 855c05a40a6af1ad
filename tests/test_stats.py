"""KL against a hand-computed case; the bootstrap against a known distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sjkvarn.eval.stats import bootstrap_ratio, kl_per_position, summary


def test_kl_hand_computed() -> None:
    p = torch.tensor([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]).log()
    q = torch.tensor([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]).log()
    kl = kl_per_position(p, q)
    # 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2
    assert kl[0] == pytest.approx(0.25 * math.log(2), rel=1e-6)
    assert kl[1] == pytest.approx(0.0, abs=1e-7)
    s = summary(np.array([1.0, 2.0, 3.0, 4.0]))
    assert s["mean"] == 2.5 and s["median"] == 2.5


def test_bootstrap_covers_the_known_ratio() -> None:
    """Exponential samples with means 2 and 1: the 95% interval of the ratio covers 2 about
    95% of the time and its width shrinks like 1/sqrt(n)."""
    rng = np.random.default_rng(7)
    covered, widths = 0, []
    trials = 200
    for t in range(trials):
        base = rng.exponential(1.0, 400)
        arm = rng.exponential(2.0, 400)
        point, lo, hi = bootstrap_ratio(arm, base, resamples=400, seed=t)
        covered += lo <= 2.0 <= hi
        widths.append(hi - lo)
        assert lo <= point <= hi
    assert 0.90 <= covered / trials <= 0.99, covered / trials
    # delta-method width for ratio of means of exponentials: ~ 2*1.96*2*sqrt(2/400) = 0.55
    assert 0.4 < float(np.mean(widths)) < 0.7


def test_cluster_bootstrap_and_errors() -> None:
    arm = np.array([1.0, 1.0, 3.0, 3.0])
    base = np.ones(4)
    point, lo, hi = bootstrap_ratio(arm, base, clusters=np.array([0, 0, 1, 1]), resamples=500)
    assert point == 2.0 and lo == pytest.approx(1.0) and hi == pytest.approx(3.0)
    with pytest.raises(ValueError):
        bootstrap_ratio(arm, base[:3])


def test_nested_bootstrap() -> None:
    from sjkvarn.eval.stats import nested_bootstrap_ratio

    rng = np.random.default_rng(1)
    outer = np.repeat([0, 1, 2, 3], 40)
    inner = np.repeat(np.arange(16), 10)
    base = rng.exponential(1.0, 160)
    arm = 3.0 * base  # a constant ratio survives any resampling
    point, lo, hi = nested_bootstrap_ratio(arm, base, outer, inner, resamples=300)
    assert point == pytest.approx(3.0) and lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    noisy = rng.exponential(2.0, 160)
    point, lo, hi = nested_bootstrap_ratio(noisy, base, outer, inner, resamples=300)
    assert lo < point < hi and hi - lo > 0.2
