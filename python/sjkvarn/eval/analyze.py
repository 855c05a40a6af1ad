"""`sjkvarn analyze`: what a model's KV cache looks like, layer by layer (seed 002's study).

Captures post-RoPE K and V over a text, then reports per layer, for K and for V: the order-0
entropy of the fp16 values, the dimensions needed for 90% of the variance per head, the cosine
between neighbouring tokens, and the normalised MSE of simple rounding schemes (per-token
absmax, per-token min-max, rotated per-token min-max, per-channel min-max over 128-token groups)
at 2/3/4 bits and of every sjkvarn format.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sjkvarn import codec
from sjkvarn.eval.report import nmse

GROUP = 128


def capture(model: Any, tokenizer: Any, text: str, tokens: int) -> list[tuple[np.ndarray, ...]]:
    """Per layer ``(K, V)``, each ``[tokens, kv_heads, head_dim]`` float32, post-RoPE."""
    import torch
    from transformers import DynamicCache

    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        cache = DynamicCache()
        model(ids, cache=cache, use_cache=True)
    out = []
    for layer in cache.layers:
        k = layer.keys[0].transpose(0, 1).float().numpy().copy()
        v = layer.values[0].transpose(0, 1).float().numpy().copy()
        out.append((k, v))
    return out


def fp16_entropy(x: np.ndarray) -> float:
    """Order-0 entropy (bits/value) of the fp16 bit patterns."""
    _, counts = np.unique(x.astype(np.float16).view(np.uint16), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def dims_for_variance(x: np.ndarray, share: float = 0.9) -> float:
    """Mean over heads of the principal components needed for ``share`` of the variance."""
    dims = []
    for h in range(x.shape[1]):
        xh = x[:, h, :].astype(np.float64)
        ev = np.linalg.eigvalsh(np.cov(xh, rowvar=False))[::-1].clip(min=0)
        dims.append(int(np.searchsorted(np.cumsum(ev) / ev.sum(), share) + 1))
    return float(np.mean(dims))


def neighbour_cosine(x: np.ndarray) -> float:
    a, b = x[:-1], x[1:]
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30
    return float((num / den).mean())


def _round(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> np.ndarray:
    top = 2**bits - 1
    step = np.where(hi > lo, (hi - lo) / top, 1.0)
    return np.clip(np.round((x - lo) / step), 0, top) * step + lo


def per_token_absmax(x: np.ndarray, bits: int) -> np.ndarray:
    m = np.abs(x).max(-1, keepdims=True)
    half = 2 ** (bits - 1) - 1
    step = np.where(m > 0, m / half, 1.0)
    return np.clip(np.round(x / step), -half - 1, half) * step


def per_token_minmax(x: np.ndarray, bits: int) -> np.ndarray:
    return _round(x, x.min(-1, keepdims=True), x.max(-1, keepdims=True), bits)


def rotated_minmax(x: np.ndarray, bits: int) -> np.ndarray:
    r = codec.rotate(x)
    return codec.rotate(per_token_minmax(r, bits))


def per_channel_minmax(x: np.ndarray, bits: int) -> np.ndarray:
    """Min/max over each 128-token group per channel (KIVI-style keys)."""
    out = np.empty_like(x)
    for s in range(0, x.shape[0], GROUP):
        g = x[s : s + GROUP]
        out[s : s + GROUP] = _round(g, g.min(0, keepdims=True), g.max(0, keepdims=True), bits)
    return out


SCHEMES = {
    "absmax": per_token_absmax,
    "minmax": per_token_minmax,
    "rot-minmax": rotated_minmax,
    "chan-minmax": per_channel_minmax,
}


def analyze_layer(k: np.ndarray, v: np.ndarray) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    groups = (k.shape[0] // GROUP) * GROUP
    tiles_k = k[:groups].reshape(-1, GROUP, *k.shape[1:]).transpose(0, 2, 1, 3)
    tiles_v = v[:groups].reshape(-1, GROUP, *v.shape[1:]).transpose(0, 2, 1, 3)
    d = k.shape[-1]
    body: dict[str, tuple[float, float]] = {}
    if groups:
        tk = np.ascontiguousarray(tiles_k.reshape(-1, GROUP, d))
        tv = np.ascontiguousarray(tiles_v.reshape(-1, GROUP, d))
        for name, kb, vb, kind in [
            ("4/4", 4, 4, "scalar"),
            ("3/3t", 3, 3, "trellis"),
            ("3/2t", 3, 2, "trellis"),
        ]:
            kw = dict(k_bits=kb, v_bits=vb, k_body=kind, v_body=kind)
            kk, vv = codec.decode_body(codec.encode_body(tk, tv, **kw), head_dim=d, **kw)
            body[name] = (nmse(tk, kk), nmse(tv, vv))
    for part, x in (("K", k), ("V", v)):
        row: dict[str, float] = {
            "entropy_fp16_bits": fp16_entropy(x),
            "dims_90pct": dims_for_variance(x),
            "neighbour_cos": neighbour_cosine(x),
        }
        for scheme, fn in SCHEMES.items():
            for bits in (2, 3, 4):
                row[f"{scheme}@{bits}"] = nmse(x, fn(x, bits))
        for fmt in codec.FORMATS:
            row[fmt] = nmse(x, codec.decode(fmt, codec.encode(fmt, x), x.shape))
        for name, (ek, ev) in body.items():
            row[f"body {name}"] = ek if part == "K" else ev
        out[part] = row
    return out


def render(rows: list[dict[str, dict[str, float]]]) -> str:
    cols = [
        "entropy_fp16_bits",
        "dims_90pct",
        "neighbour_cos",
        "minmax@4",
        "rot-minmax@4",
        "chan-minmax@4",
        "q4_0",
        "turbo4",
        "tq6_0",
        "body 4/4",
        "body 3/2t",
    ]
    short = [
        "H(fp16)",
        "dims90",
        "cos",
        "mm@4",
        "rot@4",
        "chan@4",
        "q4_0",
        "turbo4",
        "tq6_0",
        "4/4",
        "3/2t",
    ]
    lines = [f"{'layer':>5} {'':>2}" + "".join(f"{c:>10}" for c in short)]
    for i, r in enumerate(rows):
        for part in ("K", "V"):
            vals = [r[part].get(c, float("nan")) for c in cols]
            cells = [f"{vals[0]:>10.2f}", f"{vals[1]:>10.1f}", f"{vals[2]:>10.3f}"]
            cells += [f"{x:>10.2e}" for x in vals[3:]]
            lines.append(f"{i:>5} {part:>2}" + "".join(cells))
    return "\n".join(lines)
