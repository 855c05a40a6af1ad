"""KL against allocated bits for both models and both lengths, one panel each, from the pooled
held-out reports in ``docs/results/data/``: every arm's mean KL with its history-bootstrap
interval (as a ratio to KVarN 4/4 tail 0, scaled by that arm's mean), and the arms no other arm
beats on both axes joined as the frontier.

Usage: python tools/frontier_figure.py [OUT.png]  (default docs/figures/frontier_heldout.png)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sjkvarn.eval.evaluation import pareto_frontier, place_labels  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PANELS = [
    ("gemma3_heldout_16k.json", "Gemma 3 270M, 16,640 tokens"),
    ("gemma3_heldout_30k.json", "Gemma 3 270M, 30,720 tokens"),
    ("smollm2_heldout_8k.json", "SmolLM2-135M, 7,936 tokens"),
]


def main(out: Path) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.6))
    for ax, (name, title) in zip(axes, PANELS, strict=True):
        report = json.loads((ROOT / "docs/results/data" / name).read_text())
        arms = report["arms"]
        base = arms["KVarN 4/4 tail 0"]["mean"]
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
    axes[0].set_ylabel("mean KL (nats) against an exact cache")
    fig.tight_layout()
    for ax, (name, _) in zip(axes, PANELS, strict=True):
        report = json.loads((ROOT / "docs/results/data" / name).read_text())
        arms = report["arms"]
        points = {n: (a["allocated_bits"], a["mean"]) for n, a in arms.items()}
        colors = {n: "tab:blue" if n.startswith("SJ") else "tab:gray" for n in arms}
        place_labels(ax, points, colors=colors)
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/figures/frontier_heldout.png")
