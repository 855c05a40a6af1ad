"""The equal-bytes figure: its Pareto frontier and labels that do not overlap."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from sjkvarn.eval import evaluation  # noqa: E402


def test_pareto_frontier_keeps_only_unbeaten_points() -> None:
    points = {
        "a": (4.0, 1e-2),
        "b": (4.5, 2e-2),  # beaten by a (fewer bits, less KL)
        "c": (5.0, 5e-3),
        "d": (5.0, 6e-3),  # beaten by c (same bits, more KL)
        "e": (8.5, 3e-4),
        "f": (3.0, 2e-1),
    }
    assert evaluation.pareto_frontier(points) == ["f", "a", "c", "e"]


def _crowded_report(extra: list[tuple[str, float, float]] | None = None) -> dict:
    # Fourteen arms, several within a few hundredths of a bit and a few percent of KL of
    # each other: the layout a real seed-scale run gives.
    arms = {}
    specs = [
        ("KVarN 4/4 tail 0", 4.64, 7.4e-3),
        ("KVarN 4/4 tail 1024", 5.60, 2.8e-3),
        ("KVarN 3/3 tail 0", 3.67, 5.2e-2),
        ("SJ-KVaRN 4/4", 5.60, 3.9e-3),
        ("SJ-KVaRN 4/4 auto ring", 5.86, 1.4e-3),
        ("SJ-KVaRN 3/3t", 5.27, 4.7e-3),
        ("SJ-KVaRN 3/2t", 5.10, 4.5e-3),
        ("q8_0/q8_0", 8.50, 2.8e-4),
        ("q4_0/q4_0", 4.50, 6.0e-2),
        ("q8_0/q5_1", 7.25, 5.3e-4),
        ("tq5_0/turbo4", 4.62, 1.7e-2),
        ("turbo4/turbo4", 4.12, 6.9e-2),
        ("turbo3/turbo3", 3.12, 2.1e-1),
        ("tq6_0/tq6_0", 6.12, 4.4e-3),
    ] + (extra or [])
    for name, bits, kl in specs:
        arms[name] = {
            "bits_per_value": bits,
            "allocated_bits": bits,
            "mean": kl,
            "ratio": {"point": kl / 7.4e-3, "ci_positions": [0.8 * kl / 7.4e-3, 1.2 * kl / 7.4e-3]},
        }
    return {
        "settings": {"baseline": "KVarN 4/4 tail 0", "history_tokens": 12288, "scored_tokens": 256},
        "arms": arms,
    }


# Three arms at one allocation with close KL (SmolLM2's journals with f16 staging, 1,152
# tokens: their rings are allocated in full), on top of the crowd.
STACKED = [
    ("KVarN 4/4 tail 64", 17.26, 4.15e-3),
    ("SJ-KVaRN 4/4 f16 ring", 17.26, 4.81e-3),
    ("KVarN 4/4 tail 0 (f16)", 17.0, 4.48e-3),
]


@pytest.mark.parametrize("extra", [None, STACKED])
def test_labels_do_not_overlap_each_other_or_markers(tmp_path: Path, extra: list | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = _crowded_report(extra)
    points = {n: (a["allocated_bits"], a["mean"]) for n, a in report["arms"].items()}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for x, y in points.values():
        ax.plot([x], [y], "o")
    ax.set_yscale("log")
    fig.tight_layout()
    boxes = evaluation.place_labels(ax, points)
    assert len(boxes) == len(points)
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    inside = ax.get_window_extent(fig.canvas.get_renderer())
    for box in boxes:
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1, box
        for x, y in points.values():
            px, py = ax.transData.transform((x, y))
            assert not box.contains(px, py)
    plt.close(fig)
    evaluation.plot(report, tmp_path / "figure.png")
    assert (tmp_path / "figure.png").stat().st_size > 10_000
