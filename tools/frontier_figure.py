"""KL against allocated bits for both models, one panel per length and tail setting, from the
held-out reports in ``docs/results/data/`` (runs of other arms or history sets joined as
``sjkvarn eval --merge`` joins them): every arm's mean KL with its history-bootstrap interval
(the ratio's interval to the panel's baseline, scaled by the baseline's mean), and the arms no
other arm beats on both axes joined as the frontier.

Usage: python tools/frontier_figure.py [OUT.png]  (default docs/figures/frontier_heldout.png)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sjkvarn.eval.evaluation import merge_reports, pareto_frontier, place_labels  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# A panel's data: a file name, or a list of them merged (nested lists merge first).
Source = str | list["Source"]
PANELS: list[tuple[Source, str]] = [
    (
        ["gemma3_heldout_16k", ["gemma3_heldout_second_16k", "gemma3_heldout_second_16k_32t"]],
        "Gemma 3 270M, 16,640 tokens",
    ),
    ("gemma3_heldout_30k", "Gemma 3 270M, 30,720 tokens"),
    (
        ["smollm2_heldout_8k", "smollm2_heldout_second_8k"],
        "SmolLM2-135M, 7,936 tokens, tails scaled",
    ),
    (
        ["smollm2_heldout_8k_shipped_tails", "smollm2_heldout_8k_shipped_tails_32t"],
        "SmolLM2-135M, 7,936 tokens, shipped tails",
    ),
]


def load(source: Source) -> dict:
    if isinstance(source, str):
        return json.loads((ROOT / "docs/results/data" / f"{source}.json").read_text())
    return merge_reports([load(s) for s in source])


def main(out: Path) -> None:
    fig, grid = plt.subplots(2, 2, figsize=(12, 9.2))
    axes = list(grid.flat)
    reports = [load(source) for source, _ in PANELS]
    for ax, report, (_, title) in zip(axes, reports, PANELS, strict=True):
        arms = report["arms"]
        base = arms[report["settings"]["baseline"]]["mean"]
        points = {n: (a["allocated_bits"], a["mean"]) for n, a in arms.items()}
        spans = {}
        for n, a in arms.items():
            lo, hi = a["ratio"].get("ci_histories", a["ratio"]["ci_positions"])
            spans[n] = (lo * base, hi * base)
        colors = {n: "tab:blue" if n.startswith("SJ") else "tab:gray" for n in arms}
        for n, (x, y) in points.items():
            lo, hi = spans[n]
            ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], fmt="o", color=colors[n], capsize=3, ms=5)
        front = pareto_frontier(points)
        ax.plot(
            [points[n][0] for n in front],
            [points[n][1] for n in front],
            "--",
            color="tab:blue",
            lw=1,
            label="frontier",
        )
        ax.set_yscale("log")
        ax.set_xlabel("allocated bits per stored value")
        ax.set_title(f"{title}, {len(report['histories'])} held-out histories", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    for ax in (axes[0], axes[2]):
        ax.set_ylabel("mean KL (nats) against an exact cache")
    fig.tight_layout()
    for ax, report in zip(axes, reports, strict=True):
        arms = report["arms"]
        points = {n: (a["allocated_bits"], a["mean"]) for n, a in arms.items()}
        colors = {n: "tab:blue" if n.startswith("SJ") else "tab:gray" for n in arms}
        place_labels(ax, points, colors=colors)
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/figures/frontier_heldout.png")
