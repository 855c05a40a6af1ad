"""Codec error tables on synthetic tiles: every flat format and the scalar body at each width.

Errors are normalised MSE, ``sum((x - x_hat)^2) / sum(x^2)``, on seeded i.i.d. N(0, 1) and
Student-t (3 d.o.f.) tiles of 128 tokens x ``head_dim`` channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sjkvarn import codec

BODY_BITS = (2, 3, 4, 5, 6, 8)
TRELLIS_BITS = (2, 3)  # the reference trellis pairs 2/2 and 3/3 (there is no 4-bit trellis)


@dataclass(frozen=True)
class ErrorRow:
    """One line of the table: a format (or body part) and its error per distribution."""

    name: str
    bits_per_value: float
    errors: dict[str, float]


def nmse(x: np.ndarray, y: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return float(((x64 - y64) ** 2).sum() / (x64**2).sum())


def per_token_minmax(tile: np.ndarray, bits: int) -> np.ndarray:
    """Baseline: asymmetric round-to-nearest per token (row), no rotation, no balancing."""
    top = 2**bits - 1
    lo = tile.min(axis=-1, keepdims=True)
    hi = tile.max(axis=-1, keepdims=True)
    step = np.where(hi > lo, (hi - lo) / top, 1.0)
    q = np.clip(np.round((tile - lo) / step), 0, top)
    return (q * step + lo).astype(np.float32)


def synthetic_tiles(
    seed: int = 20261129, tiles: int = 16, head_dim: int = 128
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Seeded K and V tiles ``[tiles, 128, head_dim]`` per distribution."""
    rng = np.random.default_rng(seed)
    shape = (tiles, codec.GROUP, head_dim)
    return {
        "N(0,1)": (
            rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32),
        ),
        "t(3)": (
            rng.standard_t(3, shape).astype(np.float32),
            rng.standard_t(3, shape).astype(np.float32),
        ),
    }


def error_table(dists: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[ErrorRow]:
    """Error of every flat format (on the K tiles) and of the body's K and V at each width."""
    rows = []
    for fmt, info in codec.FORMATS.items():
        errors = {
            name: nmse(k, codec.decode(fmt, codec.encode(fmt, k), k.shape))
            for name, (k, _) in dists.items()
        }
        rows.append(ErrorRow(fmt, info.bits_per_value, errors))
    head_dim = next(iter(dists.values()))[0].shape[-1]
    arms = [(bits, "scalar") for bits in BODY_BITS] + [(b, "trellis") for b in TRELLIS_BITS]
    for bits, body in arms:
        layout = codec.body_layout(head_dim, bits, bits)
        kw = dict(k_bits=bits, v_bits=bits, k_body=body, v_body=body)
        k_err, v_err = {}, {}
        for name, (k, v) in dists.items():
            blob = codec.encode_body(k, v, **kw)
            kk, vv = codec.decode_body(blob, head_dim=head_dim, **kw)
            k_err[name], v_err[name] = nmse(k, kk), nmse(v, vv)
        tag = f"{bits}-bit" if body == "scalar" else f"{bits}t"
        rows.append(ErrorRow(f"body {tag} K", layout.bits_per_value, k_err))
        rows.append(ErrorRow(f"body {tag} V", layout.bits_per_value, v_err))
    return rows


def render(rows: list[ErrorRow]) -> str:
    names = list(rows[0].errors)
    lines = [f"{'format':<20}{'bits/value':>11}" + "".join(f"{n:>12}" for n in names)]
    for r in rows:
        lines.append(
            f"{r.name:<20}{r.bits_per_value:>11.3f}"
            + "".join(f"{r.errors[n]:>12.3e}" for n in names)
        )
    return "\n".join(lines)
