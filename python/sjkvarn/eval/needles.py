"""`sjkvarn eval --task needles`: facts placed in a long real-text haystack at several look-back
distances and asked for back (seed 000 section 5.3, scaled to the model's context).

Each case is a haystack of local stdlib text with one fact ("the access code for the <colour>
vault is <number>") ending ``distance`` tokens before a question about it; the gold answer is
teacher-forced. Reported per arm, per distance and pooled: KL(p||q) on the answer tokens against
the exact cache, and the rate at which the gold answer token is the arm's top-1 token; ratios to
the baseline arm get a nested cluster bootstrap (haystacks, then needles within them).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sjkvarn.eval import evaluation, stats
from sjkvarn.eval.histories import History

COLOURS = ["amber", "cobalt", "crimson", "jade", "ivory", "violet", "saffron", "teal"]


@dataclass
class NeedleSettings(evaluation.ArmSettings):
    context_tokens: int = 1536
    distances: tuple[int, ...] = (128, 384, 768, 1280)


@dataclass
class Case:
    haystack: int
    distance: int
    ids: torch.Tensor
    answer_from: int
    gold: torch.Tensor


def build_cases(tokenizer: Any, haystacks: list[History], s: NeedleSettings) -> list[Case]:
    rng = np.random.default_rng(s.seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    cases = []
    for h, hay in enumerate(haystacks):
        body = enc(hay.text)
        for i, distance in enumerate(s.distances):
            colour = COLOURS[(h * len(s.distances) + i) % len(COLOURS)]
            number = int(rng.integers(1000, 9999))
            fact = enc(f"\n# Note: the access code for the {colour} vault is {number}.\n")
            question = enc(
                f"\n# Question: what is the access code for the {colour} vault?\n"
                f"# Answer: the access code for the {colour} vault is"
            )
            answer = enc(f" {number}")
            filler = s.context_tokens - len(fact) - len(question) - len(answer)
            if distance + len(fact) > filler or len(body) < filler:
                raise ValueError(f"context {s.context_tokens} is too short for distance {distance}")
            before = filler - distance
            ids = body[:before] + fact + body[before:filler] + question + answer
            cases.append(
                Case(h, distance, torch.tensor([ids]), len(ids) - len(answer), torch.tensor(answer))
            )
    return cases


def evaluate_needles(
    model: Any, tokenizer: Any, haystacks: list[History], s: NeedleSettings, progress: bool = True
) -> dict[str, Any]:
    arms = s.select_arms()
    cases = build_cases(tokenizer, haystacks, s)
    kl: dict[str, list[float]] = {a.name: [] for a in arms}
    hit: dict[str, list[bool]] = {a.name: [] for a in arms}
    seconds = {a.name: 0.0 for a in arms}
    outer: list[int] = []
    inner: list[int] = []
    dist: list[int] = []
    bar = tqdm(total=len(cases) * (len(arms) + 1), disable=not progress, unit="run")
    for c_idx, case in enumerate(cases):
        bar.set_description(f"needle {c_idx} (distance {case.distance}): exact")
        ref, _, _ = evaluation.run_sequence(model, case.ids, case.answer_from, None)
        bar.update()
        n = ref.shape[0]
        outer.extend([case.haystack] * n)
        inner.extend([c_idx] * n)
        dist.extend([case.distance] * n)
        for arm in arms:
            bar.set_description(f"needle {c_idx} (distance {case.distance}): {arm.name}")
            start = time.perf_counter()
            logp, _, _ = evaluation.run_sequence(model, case.ids, case.answer_from, arm)
            seconds[arm.name] += time.perf_counter() - start
            kl[arm.name].extend(stats.kl_per_position(ref, logp).tolist())
            hit[arm.name].extend((logp.argmax(-1) == case.gold).tolist())
            bar.update()
    bar.close()
    base = np.array(kl[s.baseline])
    o, i, d = np.array(outer), np.array(inner), np.array(dist)
    report: dict[str, Any] = {
        "settings": asdict(s),
        "task": "needles",
        "haystacks": [h.name for h in haystacks],
        "environment": evaluation.environment(haystacks),
        "arms": {},
    }
    for name in kl:
        x, hits = np.array(kl[name]), np.array(hit[name])
        point, lo, hi = stats.nested_bootstrap_ratio(x, base, o, i, s.bootstrap, s.seed)
        report["arms"][name] = {
            "mean": float(x.mean()),
            "top1_gold": float(hits.mean()),
            "ratio": {"point": point, "ci_clusters": [lo, hi]},
            "per_distance": {
                int(dd): {
                    "mean": float(x[d == dd].mean()),
                    "top1_gold": float(hits[d == dd].mean()),
                }
                for dd in s.distances
            },
            "seconds": seconds[name],
            "positions": int(x.size),
        }
    return report


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    dists = s["distances"]
    head = f"{'arm':<22}{'mean KL':>10}{'gold top-1':>11}" + "".join(
        f"{f'KL@{d}':>10}" for d in dists
    )
    lines = [head + f"{'ratio [cluster CI]':>28}"]
    for name, a in report["arms"].items():
        r = a["ratio"]
        ci = f"{r['point']:.3f} [{r['ci_clusters'][0]:.3f}, {r['ci_clusters'][1]:.3f}]"
        cells = "".join(f"{a['per_distance'][d]['mean']:>10.2e}" for d in dists)
        lines.append(f"{name:<22}{a['mean']:>10.2e}{a['top1_gold']:>11.3f}{cells}{ci:>28}")
    return "\n".join(lines)
