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
    # "single": one fact per sequence; "shared": every distance's fact in one sequence of
    # ``context_tokens``, the questions asked one after another at its end (one long prefill
    # per haystack instead of one per distance: what makes 2K-28K distances affordable).
    layout: str = "single"


@dataclass
class Answer:
    nominal: int  # the settings' distance: from the fact's end to the question block
    distance: int  # tokens from the end of the fact to the start of its own question
    fact_end: int  # position just after the fact
    start: int  # position of the first answer token
    gold: torch.Tensor


@dataclass
class Case:
    haystack: int
    ids: torch.Tensor
    answers: list[Answer]


@dataclass
class _Needle:
    fact: list[int]
    question: list[int]
    answer: list[int]


def _needle(enc: Any, colour: str, number: int) -> _Needle:
    return _Needle(
        enc(f"\n# Note: the access code for the {colour} vault is {number}.\n"),
        enc(
            f"\n# Question: what is the access code for the {colour} vault?\n"
            f"# Answer: the access code for the {colour} vault is"
        ),
        enc(f" {number}"),
    )


def build_cases(tokenizer: Any, haystacks: list[History], s: NeedleSettings) -> list[Case]:
    if s.layout not in ("single", "shared"):
        raise ValueError(f"layout must be 'single' or 'shared', got {s.layout!r}")
    rng = np.random.default_rng(s.seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    cases = []
    for h, hay in enumerate(haystacks):
        body = enc(hay.text)
        needles = []
        for i in range(len(s.distances)):
            colour = COLOURS[(h * len(s.distances) + i) % len(COLOURS)]
            needles.append(_needle(enc, colour, int(rng.integers(1000, 9999))))
        if s.layout == "single":
            for d, n in zip(s.distances, needles, strict=True):
                cases.append(_assemble(h, body, [(d, n)], s.context_tokens))
        else:
            # Farthest first, so that no fact sits inside a later question block.
            pairs = sorted(zip(s.distances, needles, strict=True), key=lambda p: -p[0])
            cases.append(_assemble(h, body, pairs, s.context_tokens))
    return cases


def _assemble(h: int, body: list[int], pairs: list[tuple[int, _Needle]], context: int) -> Case:
    """Haystack text with each fact ending ``distance`` tokens before the question block, then
    every question with its answer. The distance is counted to the block's start; a later
    question's own distance is longer by the question blocks before it (recorded exactly)."""
    qa = [tok for _, n in pairs for tok in n.question + n.answer]
    filler = context - len(qa) - sum(len(n.fact) for _, n in pairs)
    if len(body) < filler:
        raise ValueError(f"haystack {h} has {len(body)} tokens; {filler} needed")
    ids: list[int] = []
    fact_ends = []
    taken = 0  # haystack tokens used so far
    for distance, n in pairs:  # farthest first
        later_facts = sum(len(m.fact) for d, m in pairs if d < distance)
        cut = filler - distance + later_facts
        if cut < taken:
            raise ValueError(f"context {context} is too short for distance {distance}")
        ids += body[taken:cut] + n.fact
        fact_ends.append(len(ids))
        taken = cut
    ids += body[taken:filler]
    answers = []
    for (nominal, n), fact_end in zip(pairs, fact_ends, strict=True):
        question_at = len(ids)
        ids += n.question
        answers.append(
            Answer(nominal, question_at - fact_end, fact_end, len(ids), torch.tensor(n.answer))
        )
        ids += n.answer
    return Case(h, torch.tensor([ids]), answers)


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
    actual: dict[int, list[int]] = {d: [] for d in s.distances}
    exact_hit: list[bool] = []  # the exact cache's own gold top-1: what the arms can reach
    needle = 0  # one cluster per needle
    bar = tqdm(total=len(cases) * (len(arms) + 1), disable=not progress, unit="run")

    def rows(logp: torch.Tensor, first: int, a: Answer) -> torch.Tensor:
        # log-probs row r predicts token first + r; the answer's tokens start at a.start
        return logp[a.start - first : a.start - first + len(a.gold)]

    for c_idx, case in enumerate(cases):
        first = min(a.start for a in case.answers)
        bar.set_description(f"haystack {case.haystack} case {c_idx}: exact")
        ref, _, _ = evaluation.run_sequence(model, case.ids, first, None)
        bar.update()
        for a in case.answers:
            k = len(a.gold)
            outer.extend([case.haystack] * k)
            inner.extend([needle] * k)
            needle += 1
            dist.extend([a.nominal] * k)
            actual[a.nominal].append(a.distance)
            exact_hit.extend((rows(ref, first, a).argmax(-1) == a.gold).tolist())
        for arm in arms:
            bar.set_description(f"haystack {case.haystack} case {c_idx}: {arm.name}")
            start = time.perf_counter()
            logp, _, _ = evaluation.run_sequence(model, case.ids, first, arm)
            seconds[arm.name] += time.perf_counter() - start
            for a in case.answers:
                q, p = rows(logp, first, a), rows(ref, first, a)
                kl[arm.name].extend(stats.kl_per_position(p, q).tolist())
                hit[arm.name].extend((q.argmax(-1) == a.gold).tolist())
            bar.update()
    bar.close()
    base = np.array(kl[s.baseline])
    o, i, d = np.array(outer), np.array(inner), np.array(dist)
    report: dict[str, Any] = {
        "settings": asdict(s),
        "task": "needles",
        "haystacks": [h.name for h in haystacks],
        "environment": evaluation.environment(haystacks),
        "distances_measured": {int(k): v for k, v in actual.items() if v},
        "exact_top1_gold": float(np.mean(exact_hit)),
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
    if "exact_top1_gold" in report:
        lines.append(f"{'exact cache':<22}{'':>10}{report['exact_top1_gold']:>11.3f}")
    return "\n".join(lines)
