"""Where a cache configuration loses quality: per full-attention layer, attention-output error
against exact attention, split by K and V and by ring and body, and the attention mass each
region holds at the positions that matter.

One exact forward pass captures every full-attention layer's queries at the scored positions
and its keys and values at all positions. Each configuration then stores that layer's K/V in a
one-layer sjkvarn cache (appended in the chunks a replay would use) and attends the captured
queries; the error is ``|o - o_exact| / |o_exact|`` per query row and head. Because inputs are
the exact ones, errors do not compound across layers: this isolates each layer's share. A
replay of the whole model through the configuration under study (``--replay``) adds the
per-position KL, so layer errors and region masses can be read at the positions with the
largest KL.

``python -m sjkvarn.eval.diagnose --history-tokens 16640 --out diag.json`` (Gemma 3 270M and the
seed preset's histories unless told otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sjkvarn import Cache, Config

CAPTURE = "sjkvarn-capture"

#: Each configuration: ``Config`` overrides of a one-layer cache. The seed's default
#: (tq6_0 ring, 4,096/8,192), its K-only and V-only staging variants, the ring exact or 8-bit
#: (keys as appended unless named centred), the shipped default, and paper-faithful KVarN with
#: and without its 1,024-token exact tail.
FAITHFUL = dict(staging="f16", passes=8, mode="best", centre_keys=False, exact_recent=0)
SEED_RING = dict(min_tail=4096, max_tail=8192, centre_keys=False)
SHORT_RING = dict(min_tail=2048, max_tail=4096, centre_keys=False)
CONFIGS: dict[str, dict[str, Any]] = {
    "KVarN 4/4 tail 0": dict(FAITHFUL, min_tail=0, max_tail=128),
    "KVarN 4/4 tail 1024": dict(FAITHFUL, min_tail=1024, max_tail=1152),
    "SJ ring tq6_0 (seed default)": dict(SEED_RING, staging="tq6_0"),
    "SJ ring f16 (body only)": dict(SEED_RING, staging="f16"),
    "SJ ring K tq6_0, V f16": dict(SEED_RING, staging="tq6_0/f16"),
    "SJ ring K f16, V tq6_0": dict(SEED_RING, staging="f16/tq6_0"),
    "SJ ring K q8_0, V tq6_0": dict(SEED_RING, staging="q8_0/tq6_0"),
    "SJ ring q8_0": dict(SEED_RING, staging="q8_0"),
    "SJ ring K q8_0, V tq6_0, 2048/4096": dict(SHORT_RING, staging="q8_0/tq6_0"),
    "SJ ring q8_0, 2048/4096": dict(SHORT_RING, staging="q8_0"),
    "SJ ring q8_0, 1024/2048": dict(SHORT_RING, min_tail=1024, max_tail=2048, staging="q8_0"),
    "SJ default (q8_0, 2048/3072, centred keys)": dict(min_tail=2048, max_tail=3072),
    "SJ default, exact window 64": dict(min_tail=2048, max_tail=3072, exact_recent=64),
}

#: The configurations at the tails the ``small`` preset scales to a 7,936-token history
#: (``--set small``; SmolLM2): the shipped journal's staging with a 992..1,984-token ring,
#: KVarN with a 496-token exact tail, the ring's K and V each exact or 8-bit, and the newest
#: positions read from exact copies (``exact_recent``).
SMALL_RING = dict(min_tail=992, max_tail=1984)
SMALL_CONFIGS: dict[str, dict[str, Any]] = {
    "KVarN 4/4 tail 0": dict(FAITHFUL, min_tail=0, max_tail=128),
    "KVarN 4/4 tail 496": dict(FAITHFUL, min_tail=496, max_tail=624),
    "SJ default 992/1984": dict(SMALL_RING),
    "SJ default, keys as appended": dict(SMALL_RING, centre_keys=False),
    "SJ ring f16": dict(SMALL_RING, staging="f16"),
    "SJ ring f16, faithful body": dict(SMALL_RING, staging="f16", passes=8, mode="best"),
    "SJ ring K f16, V q8_0": dict(SMALL_RING, staging="f16/q8_0"),
    "SJ ring K q8_0, V f16": dict(SMALL_RING, staging="q8_0/f16"),
    "SJ default, exact window 32": dict(SMALL_RING, exact_recent=32),
    "SJ default, exact window 64": dict(SMALL_RING, exact_recent=64),
    "SJ default, exact window 128": dict(SMALL_RING, exact_recent=128),
    "SJ keys as appended, exact window 128": dict(SMALL_RING, centre_keys=False, exact_recent=128),
    # fewer body bits: which layers the 3/2t trellis body costs, and whether keys or values
    "SJ default, 3/2t body": dict(SMALL_RING, k_bits=3, v_bits=2, body="trellis"),
    "SJ default, 3/3t body": dict(SMALL_RING, k_bits=3, v_bits=3, body="trellis"),
    "SJ default, 3/4 body": dict(SMALL_RING, k_bits=3, v_bits=4),
    "SJ default, 4/2 body": dict(SMALL_RING, k_bits=4, v_bits=2),
}
CONFIG_SETS = {"seed": CONFIGS, "small": SMALL_CONFIGS}


@dataclass
class Captured:
    """One full-attention layer at the scored positions: queries ``[S, q_heads, d]``, keys and
    values ``[N, kv_heads, d]`` (all positions), the attention scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


@dataclass
class _Recorder:
    armed: bool = False
    layers: dict[int, Captured] = field(default_factory=dict)


_RECORDER = _Recorder()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def capture(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> Any:
        if _RECORDER.armed and not getattr(module, "is_sliding", False):
            d = query.shape[-1]
            _RECORDER.layers[module.layer_idx] = Captured(
                q=query[0].transpose(0, 1).float().clone(),
                k=key[0].transpose(0, 1).float().clone(),
                v=value[0].transpose(0, 1).float().clone(),
                scale=float(scaling if scaling is not None else d**-0.5),
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )

    AttentionInterface.register(CAPTURE, capture)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)


def capture_layers(model: Any, ids: torch.Tensor, scored: int, chunk: int = 1024) -> dict:
    """Exact forward pass over ``ids``; the full-attention layers of its last ``scored``
    positions."""
    from transformers import DynamicCache

    _register()
    model.set_attn_implementation(CAPTURE)
    cache = DynamicCache(config=model.config)
    total, history = ids.shape[1], ids.shape[1] - scored
    _RECORDER.layers.clear()
    with torch.no_grad():
        pos = 0
        while pos < history:
            step = min(chunk, history - pos)
            model(ids[:, pos : pos + step], cache=cache, use_cache=True, logits_to_keep=1)
            pos += step
        _RECORDER.armed = True
        model(ids[:, history:total], cache=cache, use_cache=True, logits_to_keep=1)
        _RECORDER.armed = False
    model.set_attn_implementation("sdpa")
    return dict(_RECORDER.layers)


def exact_attention(c: Captured) -> tuple[np.ndarray, np.ndarray]:
    """Exact causal attention (float64) of the captured rows, and their probabilities
    ``[S, q_heads, N]``."""
    s_rows, qh, d = c.q.shape
    n, kvh, _ = c.k.shape
    gs = qh // kvh
    k = c.k.double().repeat_interleave(gs, dim=1)  # [N, qh, d]
    v = c.v.double().repeat_interleave(gs, dim=1)
    logits = torch.einsum("sqd,nqd->sqn", c.q.double(), k) * c.scale
    rows = torch.arange(n - s_rows, n)[:, None, None]
    logits = logits.masked_fill(torch.arange(n)[None, None, :] > rows, -math.inf)
    p = torch.softmax(logits, dim=-1)
    out = torch.einsum("sqn,nqd->sqd", p, v)
    return out.numpy(), p.numpy()


def cached_attention(c: Captured, overrides: dict[str, Any]) -> tuple[np.ndarray, dict]:
    """The captured rows attended through a one-layer sjkvarn cache of ``overrides``, fed as a
    replay feeds it (chunks of at most 256 that stop at seals; the scored rows attend as their
    chunk is appended). Returns the output and the regions at the end."""
    s_rows, qh, d = c.q.shape
    n, kvh, _ = c.k.shape
    cfg = Config(
        layers=1,
        kv_heads=kvh,
        q_heads=qh,
        head_dim=d,
        max_tokens=n + 1,
        max_chunk=256,
        **overrides,
    )
    cache = Cache(cfg)
    k, v, q = c.k.numpy(), c.v.numpy(), c.q.numpy()
    history = n - s_rows
    out = np.zeros((s_rows, qh, d), np.float32)
    pos = 0
    while pos < n:
        end = pos + min(256, cache.chunk_limit(0), (history if pos < history else n) - pos)
        cache.append(0, k[pos:end], v[pos:end])
        if end > history:
            first = max(pos, history)
            rows = q[first - history : end - history]
            got = cache.attend(0, np.ascontiguousarray(rows), scale=c.scale)
            out[first - history : end - history] = got[-(end - first) :]
        pos = end
    return out, cache.regions(0)


def relative_error(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``|got - want| / |want|`` per row and head ``[S, q_heads]``."""
    num = np.linalg.norm(got - want, axis=-1)
    return num / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)


def region_mass(p: np.ndarray, regions: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Attention probability on each region per row and head ``[S, q_heads]``."""
    return {name: p[..., a:b].sum(-1) for name, (a, b) in regions.items()}


def diagnose_history(
    model: Any, ids: torch.Tensor, scored: int, configs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    layers = capture_layers(model, ids, scored)
    result: dict[str, Any] = {}
    for index in sorted(layers):
        c = layers[index]
        want, p = exact_attention(c)
        per_config: dict[str, Any] = {}
        for name, overrides in configs.items():
            got, regions = cached_attention(c, overrides)
            err = relative_error(got, want)
            mass = region_mass(p, regions)
            per_config[name] = {
                "error_per_row": err.mean(axis=1).tolist(),
                "mean_error": float(err.mean()),
                "p99_error": float(np.quantile(err, 0.99)),
                "regions": {k: list(r) for k, r in regions.items()},
                "mass": {k: float(m.mean()) for k, m in mass.items()},
                "mass_per_row": {k: m.mean(axis=1).tolist() for k, m in mass.items()},
            }
        newest = {w: float(p[..., -w:].sum(-1).mean()) for w in (128, 1024, 4096, 8192)}
        result[str(index)] = {
            "configs": per_config,
            "mass_on_newest": newest,
            "key_norm_spread": float(c.k.norm(dim=-1).std() / c.k.norm(dim=-1).mean()),
            "key_channel_peak": float(
                (c.k.abs().amax(dim=(0, 1)) / c.k.abs().mean(dim=(0, 1))).max()
            ),
        }
    return result


def sink_mass(layer: dict[str, Any]) -> float:
    """Exact attention mass on the sink's positions in one layer's entry (every configuration
    of a diagnosis shares the exact probabilities; KVarN's have no sink region)."""
    masses = (c["mass"]["sink"] for c in layer["configs"].values() if "sink" in c["mass"])
    return next(masses, float("nan"))


def summarize(report: dict[str, Any], top: float = 0.05) -> str:
    """Markdown tables of a diagnosis: per layer, each configuration's mean attention-output
    error (mean over histories), the attention mass on the newest positions, and, where a
    replay ran, the error and ring mass at the positions with the top ``top`` share of KL."""
    hist = report["histories"]
    layers = sorted(next(iter(hist.values()))["layers"], key=int)
    configs = list(next(iter(hist.values()))["layers"][layers[0]]["configs"])
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    lines = [
        f"Attention-output error `|o - o_exact| / |o_exact|`, {report['history_tokens']:,}-token "
        f"histories ({', '.join(hist)}), mean over scored rows, heads and histories:",
        "",
        "| configuration | " + " | ".join(f"layer {ly}" for ly in layers) + " |",
        "|---|" + "---:|" * len(layers),
    ]
    for c in configs:
        cells = [
            f"{mean([h['layers'][ly]['configs'][c]['mean_error'] for h in hist.values()]):.4f}"
            for ly in layers
        ]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Exact attention mass on the sink (positions 0..127) and on the newest positions (mean "
        "over rows, heads, histories):",
        "",
    ]
    windows = list(next(iter(hist.values()))["layers"][layers[0]]["mass_on_newest"])
    lines += ["| layer | sink | " + " | ".join(f"newest {w}" for w in windows) + " |"]
    lines += ["|---|---:|" + "---:|" * len(windows)]
    for ly in layers:
        sink = mean([sink_mass(h["layers"][ly]) for h in hist.values()])
        cells = [
            f"{mean([h['layers'][ly]['mass_on_newest'][w] for h in hist.values()]):.3f}"
            for w in windows
        ]
        lines.append(f"| {ly} | {sink:.3f} | " + " | ".join(cells) + " |")
    replays = {n: h for n, h in hist.items() if "replay" in h}
    if replays:
        arm = next(iter(replays.values()))["replay"]["arm"]
        default = next(c for c in configs if "seed default" in c or "SJ default" in c)
        lines += [
            "",
            f"Replay of `{arm}`: at the {top:.0%} of scored positions with the largest KL "
            "against all positions (mean over histories):",
            "",
            "| layer | error, top-KL rows | error, all rows | ring mass, top-KL rows | "
            "ring mass, all rows |",
            "|---|---:|---:|---:|---:|",
        ]
        for ly in layers:
            e_top, e_all, m_top, m_all = [], [], [], []
            for h in replays.values():
                kl = np.array(h["replay"]["kl"])
                cut = np.quantile(kl, 1 - top)
                worst = kl >= cut
                cfg = h["layers"][ly]["configs"][default]
                err, ring = np.array(cfg["error_per_row"]), np.array(cfg["mass_per_row"]["ring"])
                n = min(len(kl), len(err))
                e_top.append(err[:n][worst[:n]].mean())
                e_all.append(err[:n].mean())
                m_top.append(ring[:n][worst[:n]].mean())
                m_all.append(ring[:n].mean())
            lines.append(
                f"| {ly} | {mean(e_top):.4f} | {mean(e_all):.4f} | {mean(m_top):.3f} | "
                f"{mean(m_all):.3f} |"
            )
        kl_share = [
            np.sort(np.array(h["replay"]["kl"]))[::-1][
                : max(1, int(top * len(h["replay"]["kl"])))
            ].sum()
            / np.array(h["replay"]["kl"]).sum()
            for h in replays.values()
        ]
        lines += ["", f"Share of the mean KL carried by those positions: {mean(kl_share):.0%}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from sjkvarn.eval import evaluation, histories, models, stats

    ap = argparse.ArgumentParser(prog="python -m sjkvarn.eval.diagnose", description=__doc__)
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--text", action="append", default=None, help="history file (repeatable)")
    ap.add_argument("--history-tokens", type=int, default=16640)
    ap.add_argument("--scored-tokens", type=int, default=256)
    ap.add_argument(
        "--set",
        choices=sorted(CONFIG_SETS),
        default="seed",
        help="configurations at the seed's tails, or the small preset's (SmolLM2 at 7,936)",
    )
    ap.add_argument("--configs", nargs="+", default=None, help="subset of config names")
    ap.add_argument(
        "--replay",
        default=None,
        help="also replay the model through this eval arm (per-position KL)",
    )
    ap.add_argument("--out", required=True, help="results JSON (written, or read with --summarize)")
    ap.add_argument("--summarize", action="store_true", help="print the tables of --out")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(json.loads(Path(args.out).read_text())), end="")
        return 0
    hist = [histories.from_file(p) for p in args.text] if args.text else histories.seed_scale()
    chosen = CONFIG_SETS[args.set]
    configs = {k: v for k, v in chosen.items() if not args.configs or k in args.configs}
    net, tok = models.load(args.model)
    settings = evaluation.EvalSettings(
        history_tokens=args.history_tokens, scored_tokens=args.scored_tokens, preset="seed"
    )
    report: dict[str, Any] = {"history_tokens": args.history_tokens, "histories": {}}
    for h in hist:
        ids = evaluation.prepare_ids(net, tok, h, settings)
        entry: dict[str, Any] = {"layers": diagnose_history(net, ids, args.scored_tokens, configs)}
        if args.replay:
            arm = next(a for a in evaluation.seed_arms() if a.name == args.replay)
            ref, _, _ = evaluation.run_sequence(net, ids, args.history_tokens, None)
            logp, _, _ = evaluation.run_sequence(net, ids, args.history_tokens, arm)
            entry["replay"] = {"arm": arm.name, "kl": stats.kl_per_position(ref, logp).tolist()}
        report["histories"][h.name] = entry
        print(f"{h.name}: done", flush=True)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
