"""Error tables on Gaussian and Student-t tiles, and the reason the body codec exists.

Run ``pytest tests/test_error_tables.py -s`` (or read the -rP report) to see the tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import codec
from sjkvarn.eval.report import (
    BODY_BITS,
    error_table,
    nmse,
    per_token_minmax,
    render,
    synthetic_tiles,
)


def test_print_error_tables() -> None:
    dists = synthetic_tiles()
    rows = error_table(dists)
    print("\n" + render(rows))
    by_name = {r.name: r.errors for r in rows}
    for d in dists:
        # more bits never hurt, within each family
        body = [by_name[f"body {b}-bit K"][d] for b in BODY_BITS]
        assert all(a > b for a, b in zip(body, body[1:], strict=False)), body
        tq = [by_name[f][d] for f in ("turbo3", "turbo4", "tq5_0", "tq6_0")]
        assert all(a > b for a, b in zip(tq, tq[1:], strict=False)), tq
        gg = [by_name[f][d] for f in ("q4_0", "q5_0", "q8_0", "f16")]
        assert all(a > b for a, b in zip(gg, gg[1:], strict=False)), gg
    # On Gaussian data the rotated Lloyd-Max formats sit at the Lloyd-Max distortion
    # (0.03454 at 3 bits, 0.009497 at 4), and 4-bit min/max rounding near step^2/12.
    assert by_name["turbo3"]["N(0,1)"] == pytest.approx(0.0345, rel=0.05)
    assert by_name["turbo4"]["N(0,1)"] == pytest.approx(0.0095, rel=0.05)
    assert by_name["body 4-bit V"]["N(0,1)"] < 0.0105


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_body_beats_per_token_rounding_with_an_outlier_channel(
    bits: int, rng: np.random.Generator
) -> None:
    shape = (16, 128, 128)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[..., 17] *= 20.0
    v[..., 17] *= 20.0
    blob = codec.encode_body(k, v, k_bits=bits, v_bits=bits)
    kk, vv = codec.decode_body(blob, head_dim=128, k_bits=bits, v_bits=bits)
    body_k, body_v = nmse(k, kk), nmse(v, vv)
    base_k, base_v = nmse(k, per_token_minmax(k, bits)), nmse(v, per_token_minmax(v, bits))
    print(
        f"\n{bits}-bit, one channel x20: body K {body_k:.3e} V {body_v:.3e} | "
        f"per-token min-max K {base_k:.3e} V {base_v:.3e} | ratio K {body_k / base_k:.3f} "
        f"V {body_v / base_v:.3f}"
    )
    assert body_k < base_k
    assert body_v < base_v
