"""`sjkvarn eval --task positions`: KL against position over one long history.

The exact reference and every arm run side by side over the same tokens, one 256-token chunk at
a time (a journal arm splits a chunk at its seal events), so the full next-token distribution of
every position is compared without keeping 30K of them (Gemma's vocabulary is 262K wide). The
report gives the mean KL per bin of positions, each arm's ratio to the baseline per bin and
after the first seal with a bootstrap over 64-token blocks (neighbouring positions are not
independent), and how much of each journal arm's cache sat in sealed records along the way.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sjkvarn.eval import evaluation, stats
from sjkvarn.eval.histories import History

BLOCK = 64  # tokens per bootstrap block
OUTPUTS = ("positions.json", "positions_kl.npz", "kl_vs_position.png")

# The arms of a positions run when none are named: the baseline, KVarN with its exact tail,
# and the SJ-KVaRN bodies at 4/4 (fixed and auto ring) and 3/2t.
DEFAULT_ARMS = ("KVarN 4/4 tail 1024", "SJ-KVaRN 4/4", "SJ-KVaRN 4/4 auto ring", "SJ-KVaRN 3/2t")


@dataclass
class PositionSettings(evaluation.ArmSettings):
    context_tokens: int = 30720
    bin_tokens: int = 1024
    chunk: int = 256


def evaluate_positions(
    model: Any, tokenizer: Any, history: History, s: PositionSettings, progress: bool = True
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The report and every arm's KL per position."""
    if s.bin_tokens < BLOCK or s.bin_tokens % BLOCK:
        raise ValueError(f"bin_tokens must be a multiple of {BLOCK}, got {s.bin_tokens}")
    arms = s.select_arms()
    ids = tokenizer(history.text, return_tensors="pt").input_ids
    total = s.context_tokens
    if ids.shape[1] < total:
        raise ValueError(f"history {history.name!r} has {ids.shape[1]} tokens; {total} needed")
    ids = ids[:, :total]
    names = [a.name for a in arms]
    ref = evaluation.Replay(model, None, total, s.chunk)
    replays = [evaluation.Replay(model, a, total, s.chunk) for a in arms]
    kl = {n: np.zeros(total - 1) for n in names}
    top1 = {n: np.zeros(total - 1, dtype=bool) for n in names}
    sealed: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
    seconds = dict.fromkeys(names, 0.0)
    bar = tqdm(total=total, disable=not progress, unit="tok", desc=f"{history.name}: positions")
    pos = 0
    with torch.no_grad():
        while pos < total:
            end = min(pos + s.chunk, total)
            scored = min(end, total - 1) - pos  # the last token predicts nothing scored
            p = ref.forward(ids[:, pos:end], end - pos)[:scored]
            for name, replay in zip(names, replays, strict=True):
                start = time.perf_counter()
                parts, at = [], pos
                while at < end:  # a journal arm stops at its seal events
                    step = min(replay.step(at), end - at)
                    parts.append(replay.forward(ids[:, at : at + step], step))
                    at += step
                q = torch.cat(parts)[:scored]
                seconds[name] += time.perf_counter() - start
                kl[name][pos : pos + scored] = stats.kl_per_position(p, q)
                top1[name][pos : pos + scored] = (q.argmax(-1) == p.argmax(-1)).numpy()
                share = replay.sealed_fraction()
                if share is not None:
                    sealed[name].append((end, share))
            bar.update(end - pos)
            pos = end
    bar.close()
    return _report(history, s, names, kl, top1, sealed, seconds, replays), kl


def _report(
    history: History,
    s: PositionSettings,
    names: list[str],
    kl: dict[str, np.ndarray],
    top1: dict[str, np.ndarray],
    sealed: dict[str, list[tuple[int, float]]],
    seconds: dict[str, float],
    replays: list[evaluation.Replay],
) -> dict[str, Any]:
    base = kl[s.baseline]
    n = base.size
    blocks = np.arange(n) // BLOCK
    edges = list(range(0, n, s.bin_tokens)) + [n]
    # From the first position where every journal arm has sealed, each answers partly from
    # sealed records: the ratios are taken from there on.
    firsts = [
        next((end for end, share in sealed[name] if share > 0), n) for name in names if sealed[name]
    ]
    first_seal = min(max(firsts, default=0), n - 1)
    report: dict[str, Any] = {
        "settings": asdict(s),
        "task": "positions",
        "history": history.name,
        "environment": evaluation.environment([history]),
        "bins": [[a, b] for a, b in zip(edges[:-1], edges[1:], strict=True)],
        "first_seal": first_seal,
        "arms": {},
    }
    for name, replay in zip(names, replays, strict=True):
        x = kl[name]
        per_bin = []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            point, lo, hi = stats.bootstrap_ratio(
                x[a:b], base[a:b], s.bootstrap, s.seed, clusters=blocks[a:b]
            )
            per_bin.append(
                {
                    "mean": float(x[a:b].mean()),
                    "top1": float(top1[name][a:b].mean()),
                    "ratio": [point, lo, hi],
                }
            )
        after = slice(first_seal, n)
        point, lo, hi = stats.bootstrap_ratio(
            x[after], base[after], s.bootstrap, s.seed, clusters=blocks[after]
        )
        info: dict[str, Any] = {}
        replay.allocated(info)
        report["arms"][name] = {
            "mean": float(x.mean()),
            "mean_after_first_seal": float(x[after].mean()),
            "ratio_after_first_seal": {"point": point, "ci_blocks": [lo, hi]},
            "top1": float(top1[name].mean()),
            "allocated_bits": info["allocated_bits"],
            "sealed": sealed[name],
            "per_bin": per_bin,
            "seconds": seconds[name],
        }
    return report


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    bins = report["bins"]
    picks = [i for i in range(len(bins)) if i % max(1, len(bins) // 6) == 0 or i == len(bins) - 1]
    head = f"{'arm':<24}{'alloc bits':>11}{'mean KL':>10}" + "".join(
        f"{f'@{bins[i][1] / 1024:g}K':>10}" for i in picks
    )
    lines = [head + f"{'ratio after seal [CI]':>28}"]
    for name, a in report["arms"].items():
        r = a["ratio_after_first_seal"]
        ci = f"{r['point']:.3f} [{r['ci_blocks'][0]:.3f}, {r['ci_blocks'][1]:.3f}]"
        cells = "".join(f"{a['per_bin'][i]['mean']:>10.2e}" for i in picks)
        lines.append(f"{name:<24}{a['allocated_bits']:>11.2f}{a['mean']:>10.2e}{cells}{ci:>28}")
    lines.append(
        f"(mean KL per {s['bin_tokens']}-token bin ending at the position shown; ratios to "
        f"{s['baseline']} from position {report['first_seal']}, where every journal arm has "
        f"sealed, with a "
        f"bootstrap over {BLOCK}-token blocks)"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Mean KL per bin against position (log scale), and below it the share of each journal
    arm's cached tokens held in sealed records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    mids = [(a + b) / 2 for a, b in report["bins"]]
    for name, a in report["arms"].items():
        (line,) = top.plot(mids, [b["mean"] for b in a["per_bin"]], marker="o", ms=3, label=name)
        if a["sealed"] and any(share > 0 for _, share in a["sealed"]):
            xs, ys = zip(*a["sealed"], strict=True)
            bottom.plot(xs, ys, color=line.get_color(), lw=1)
    top.set_yscale("log")
    top.set_ylabel("mean KL(p || q) per bin, nats")
    top.axvline(report["first_seal"], color="0.5", lw=0.8, ls=":")
    top.annotate(
        "every journal arm has sealed",
        (report["first_seal"], 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12),
        textcoords="offset points",
        fontsize=7,
        color="0.4",
    )
    top.legend(fontsize=8)
    top.set_title(
        f"KL against position: {report['history']}, {report['settings']['context_tokens']} tokens"
    )
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("sealed share")
    bottom.set_xlabel("position (tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], kl: dict[str, np.ndarray], out: Path) -> None:
    """positions.json (the report), positions_kl.npz (KL per position) and the figure."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "positions.json").write_text(json.dumps(report, indent=1))
    np.savez_compressed(out / "positions_kl.npz", **kl)
    plot(report, out / "kl_vs_position.png")
