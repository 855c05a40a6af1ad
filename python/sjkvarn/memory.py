"""KV-cache allocation per format and the largest context that fits a memory budget.

Flat formats allocate ``bits/value x values``. An SJ-KVaRN cache allocates, per full-attention
layer: the fp16 sink (128 tokens), the staging ring in full up front
(``PAD(max_tail + 128 + 2*max_chunk, 128)`` rows in the journal's K and V staging types: by
default ``q8_0`` keys and ``tq6_0`` values, the reference ``tq6_0`` for both), and one body
record per sealed
128-token group; at a context of ``N`` tokens the body holds ``N - 128 - min_tail`` tokens (just
after a seal). GB = 1,024 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from sjkvarn import codec
from sjkvarn.cache import DEFAULT_JOURNAL, REFERENCE_JOURNAL

GIB = 1024**3

#: name -> (full-attention layers, KV heads, head_dim)
KNOWN_MODELS: dict[str, tuple[int, int, int]] = {
    "qwen3.8-27b": (16, 4, 256),
    "gemma4-31b": (10, 4, 512),
    "smollm2-135m": (30, 3, 64),
}

#: (name, K format or bits, V format or bits, body) in report order
FLAT_ARMS = ["f16", "q8_0", "q5_1", "q4_0", "tq6_0", "tq5_0", "turbo4", "turbo3"]
SJ_ARMS = [
    ("SJ-KVaRN 4/4", 4, 4, "scalar"),
    ("SJ-KVaRN 3/3t", 3, 3, "trellis"),
    ("SJ-KVaRN 3/2t", 3, 2, "trellis"),
]


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def values_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2  # K and V


def geometry(
    model: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> Geometry:
    if model is not None:
        key = model.lower()
        if key not in KNOWN_MODELS:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(KNOWN_MODELS)}")
        return Geometry(*KNOWN_MODELS[key])
    if not (layers and kv_heads and head_dim):
        raise ValueError("give --model, or --layers, --kv-heads and --head-dim")
    return Geometry(layers, kv_heads, head_dim)


def staging_row_bytes(head_dim: int, staging: str = "tq6_0") -> int:
    """Bytes of one staging row of ``head_dim`` values: ``tq6_0`` (blocks of 128 values, or 64
    for 64-wide heads), ``q8_0`` (blocks of 32) or ``f16``."""
    if staging == "q8_0":
        return head_dim // 32 * 34
    if staging == "f16":
        return head_dim * 2
    block = min(head_dim, 128)
    return head_dim // block * (2 + block * 6 // 8)


@dataclass(frozen=True)
class Journal:
    """Tails, ring staging (``"K/V"`` or one type for both) and the exact window; the defaults
    are ``Config()``'s journal on the CPU, :meth:`reference` the reference codec's."""

    min_tail: int = DEFAULT_JOURNAL["min_tail"]
    max_tail: int = DEFAULT_JOURNAL["max_tail"]
    max_chunk: int = 512
    staging: str = DEFAULT_JOURNAL["staging"]
    exact_recent: int = DEFAULT_JOURNAL["exact_recent"]

    @classmethod
    def reference(cls, **fields: int) -> Journal:
        sizes = {
            k: v
            for k, v in REFERENCE_JOURNAL.items()
            if k in ("min_tail", "max_tail", "staging", "exact_recent")
        }
        return cls(**{**sizes, **fields})

    @property
    def ring_rows(self) -> int:
        """The reference's ring size: ``PAD(max(tail, tail_max) + G + 2 * n_ubatch, 128)``."""
        need = max(self.min_tail, self.max_tail) + codec.GROUP + 2 * self.max_chunk
        return -(-need // 128) * 128

    def ring_row_bytes(self, head_dim: int) -> int:
        """Bytes of one ring position of one KV head (its K row and its V row)."""
        k, _, v = self.staging.partition("/")
        return staging_row_bytes(head_dim, k) + staging_row_bytes(head_dim, v or k)


def flat_bytes(fmt: str, geo: Geometry, tokens: int) -> float:
    return codec.format_info(fmt).bits_per_value * geo.values_per_token * tokens / 8


def sjkvarn_bytes(
    k_bits: int, v_bits: int, geo: Geometry, tokens: int, journal: Journal = Journal()
) -> float:
    heads = geo.layers * geo.kv_heads
    sink = heads * 128 * geo.head_dim * 2 * 2
    ring = heads * journal.ring_rows * journal.ring_row_bytes(geo.head_dim)
    window = heads * journal.exact_recent * geo.head_dim * 2 * 2
    record = codec.body_layout(geo.head_dim, k_bits, v_bits).record_bytes
    body_tokens = max(0, tokens - 128 - journal.min_tail)
    return sink + ring + window + heads * record * body_tokens / codec.GROUP


def table(
    geo: Geometry, tokens: int, budget_gb: float | None, journal: Journal = Journal()
) -> list[dict[str, float | str | int | None]]:
    """Allocation at ``tokens`` and the largest context within ``budget_gb`` for every arm."""
    rows: list[dict[str, float | str | int | None]] = []
    arms: list[tuple[str, object]] = [(f, f) for f in FLAT_ARMS]
    arms += [(name, (k, v)) for name, k, v, _ in SJ_ARMS]
    for name, arm in arms:

        def alloc(n: int, arm: object = arm) -> float:
            if isinstance(arm, str):
                return flat_bytes(arm, geo, n)
            k, v = arm  # type: ignore[misc]
            return sjkvarn_bytes(k, v, geo, n, journal)

        fit = None
        if budget_gb is not None:
            lo, hi = 0, 1
            while alloc(hi) <= budget_gb * GIB and hi < 1 << 40:
                hi *= 2
            while lo + 1 < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if alloc(mid) <= budget_gb * GIB else (lo, mid)
            fit = lo
        rows.append(
            {
                "format": name,
                "gb": alloc(tokens) / GIB,
                "bits_per_value": alloc(tokens) * 8 / (geo.values_per_token * tokens),
                "max_tokens": fit,
            }
        )
    return rows


def render(
    rows: list[dict[str, float | str | int | None]], tokens: int, budget_gb: float | None
) -> str:
    head = f"{'format':<16}{'bits/value':>11}{f'GB at {tokens:,}':>18}"
    if budget_gb is not None:
        head += f"{f'max context in {budget_gb:g} GB':>28}"
    lines = [head]
    for r in rows:
        line = f"{r['format']:<16}{r['bits_per_value']:>11.3f}{r['gb']:>18.3f}"
        if budget_gb is not None:
            line += f"{r['max_tokens']:>28,}"
        lines.append(line)
    return "\n".join(lines)
