"""The trellis body (the SJ-KVaRN reference's 3/3, 3/2 and 2/2): codebooks, records, errors,
determinism."""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import CodecError, codec
from sjkvarn.eval.report import nmse


@pytest.mark.parametrize("bits", [2, 3])
def test_reference_codebooks_have_separate_key_and_value_tables(bits: int) -> None:
    k, v = codec.trellis_codebook(bits), codec.trellis_codebook(bits, values=True)
    assert k.shape == v.shape == (2 ** (6 + bits),)
    assert not np.array_equal(k, v)
    # values are in units of the row step: they span the code range 0 .. 2^bits - 1 and a bit
    assert k.min() >= 0.0 and k.max() <= 2**bits
    with pytest.raises(CodecError, match="bit width"):
        codec.trellis_codebook(4)


def test_only_the_reference_trellis_pairs_exist() -> None:
    t = np.zeros((128, 64), dtype=np.float32)
    for k_bits, v_bits in [(4, 4), (2, 3), (4, 2)]:
        with pytest.raises(CodecError, match="trellis"):
            codec.encode_body(
                t, t, k_bits=k_bits, v_bits=v_bits, k_body="trellis", v_body="trellis"
            )
    with pytest.raises(CodecError, match="trellis"):
        codec.encode_body(t, t, k_bits=3, v_bits=3, k_body="trellis", v_body="scalar")
    with pytest.raises(CodecError, match="body must be"):
        codec.encode_body(t, t, k_body="lattice")
    with pytest.raises(CodecError, match="body must be"):
        codec.encode_body(t, t, k_body="trellis-channel", v_body="trellis-channel")


@pytest.mark.parametrize("head_dim", [64, 256, 512])
@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (3, 2), (2, 2)])
def test_trellis_records_same_size_lower_error(head_dim: int, k_bits: int, v_bits: int) -> None:
    rng = np.random.default_rng(head_dim)
    k = rng.standard_normal((2, 128, head_dim)).astype(np.float32)
    v = rng.standard_t(5, (2, 128, head_dim)).astype(np.float32)
    kw = dict(k_bits=k_bits, v_bits=v_bits)
    scalar = codec.encode_body(k, v, **kw)
    coded = codec.encode_body(k, v, k_body="trellis", v_body="trellis", **kw)
    assert len(coded) == len(scalar)
    ks, vs = codec.decode_body(scalar, head_dim=head_dim, **kw)
    kt, vt = codec.decode_body(coded, head_dim=head_dim, k_body="trellis", v_body="trellis", **kw)
    # the reference codebooks were trained on real activations, not i.i.d. noise: on these
    # synthetic tiles the trellis still has clearly less error than rounding
    assert nmse(k, kt) < 0.8 * nmse(k, ks)
    assert nmse(v, vt) < 0.8 * nmse(v, vs)


def test_trellis_record_determinism() -> None:
    rng = np.random.default_rng(3)
    k = rng.standard_normal((4, 128, 128)).astype(np.float32)
    v = rng.standard_normal((4, 128, 128)).astype(np.float32)
    kw = dict(k_bits=3, v_bits=2, k_body="trellis", v_body="trellis")
    one = codec.encode_body(k, v, threads=1, **kw)
    assert codec.encode_body(k, v, threads=2, **kw) == one
    assert b"".join(codec.encode_body(k[i], v[i], **kw) for i in range(4)) == one
