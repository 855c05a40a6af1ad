"""Error tables on Gaussian and Student-t tiles, and the reason the body codec exists.

Errors are normalised MSE: sum((x - x_hat)^2) / sum(x^2) over the whole tensor.
Run ``pytest tests/test_error_tables.py -s`` (or read the -rP report) to see the tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import codec

BITS = [2, 3, 4, 5, 6, 8]
TILES = 16
HEAD_DIM = 128


def nmse(x: np.ndarray, y: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return float(((x64 - y64) ** 2).sum() / (x64**2).sum())


def per_token_minmax(tile: np.ndarray, bits: int) -> np.ndarray:
    """Asymmetric round-to-nearest per token (row), no rotation, no balancing."""
    top = 2**bits - 1
    lo = tile.min(axis=-1, keepdims=True)
    hi = tile.max(axis=-1, keepdims=True)
    step = np.where(hi > lo, (hi - lo) / top, 1.0)
    q = np.clip(np.round((tile - lo) / step), 0, top)
    return (q * step + lo).astype(np.float32)


def distributions(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    shape = (TILES, 128, HEAD_DIM)
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


def test_print_error_tables(rng: np.random.Generator) -> None:
    dists = distributions(rng)
    lines = [f"{'format':<22}{'bits/value':>11}" + "".join(f"{d:>12}" for d in dists)]
    flat_rows: dict[str, list[float]] = {}
    for fmt, info in codec.FORMATS.items():
        errs = []
        for k, _ in dists.values():
            errs.append(nmse(k, codec.decode(fmt, codec.encode(fmt, k), k.shape)))
        flat_rows[fmt] = errs
        lines.append(f"{fmt:<22}{info.bits_per_value:>11.3f}" + "".join(f"{e:>12.3e}" for e in errs))
    body_rows: dict[int, list[float]] = {}
    for bits in BITS:
        layout = codec.body_layout(HEAD_DIM, bits, bits)
        for part in ("K", "V"):
            errs = []
            for k, v in dists.values():
                blob = codec.encode_body(k, v, k_bits=bits, v_bits=bits)
                kk, vv = codec.decode_body(blob, head_dim=HEAD_DIM, k_bits=bits, v_bits=bits)
                errs.append(nmse(k, kk) if part == "K" else nmse(v, vv))
            if part == "K":
                body_rows[bits] = errs
            name = f"body {bits}-bit {part}"
            lines.append(
                f"{name:<22}{layout.bits_per_value:>11.3f}" + "".join(f"{e:>12.3e}" for e in errs)
            )
    print(f"\nnormalised MSE, {TILES} tiles of 128 tokens x {HEAD_DIM} channels\n" + "\n".join(lines))

    # Sanity of the table itself: more bits never hurt, within each family.
    for d in range(len(dists)):
        body = [body_rows[b][d] for b in BITS]
        assert all(a > b for a, b in zip(body, body[1:])), body
        assert flat_rows["turbo3"][d] > flat_rows["turbo4"][d] > flat_rows["tq5_0"][d] > flat_rows["tq6_0"][d]
        assert flat_rows["q4_0"][d] > flat_rows["q5_0"][d] > flat_rows["q8_0"][d] > flat_rows["f16"][d]
    # On Gaussian data the rotated Lloyd-Max formats sit near the Lloyd-Max distortion.
    assert flat_rows["turbo3"][0] == pytest.approx(0.0345, rel=0.1)
    assert flat_rows["turbo4"][0] == pytest.approx(0.0095, rel=0.1)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_body_beats_per_token_rounding_with_an_outlier_channel(
    bits: int, rng: np.random.Generator
) -> None:
    shape = (TILES, 128, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[..., 17] *= 20.0
    v[..., 17] *= 20.0
    blob = codec.encode_body(k, v, k_bits=bits, v_bits=bits)
    kk, vv = codec.decode_body(blob, head_dim=HEAD_DIM, k_bits=bits, v_bits=bits)
    body_k, body_v = nmse(k, kk), nmse(v, vv)
    base_k, base_v = nmse(k, per_token_minmax(k, bits)), nmse(v, per_token_minmax(v, bits))
    print(
        f"\n{bits}-bit, one channel x20: body K {body_k:.3e} V {body_v:.3e} | "
        f"per-token min-max K {base_k:.3e} V {base_v:.3e} | ratio K {body_k / base_k:.3f} "
        f"V {body_v / base_v:.3f}"
    )
    assert body_k < base_k
    assert body_v < base_v
