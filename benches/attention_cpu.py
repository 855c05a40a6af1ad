"""CPU decode attention over the compressed cache vs torch SDPA over a float32 cache.

One layer with SmolLM2-135M's geometry (9 query heads over 3 KV heads of 64) by default; the
cache is filled with random K/V, then one decode query is timed on each side, side by side in
the same process (median of repeats). Reports times and the ratio.

Usage: python benches/attention_cpu.py [--tokens 4096 16384 65536] [--bits 4] [--body scalar]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sjkvarn


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--body", default="scalar")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    qh, kvh, d = args.q_heads, args.kv_heads, args.head_dim
    print(
        f"decode attention, {qh} q heads / {kvh} KV heads x {d}, {args.bits}/{args.bits} "
        f"{args.body}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'tokens':>8} {'sjkvarn ms':>11} {'sdpa fp32 ms':>13} {'ratio':>7} {'bits/value':>11}")
    for n in args.tokens:
        cfg = sjkvarn.Config(
            layers=1,
            kv_heads=kvh,
            q_heads=qh,
            head_dim=d,
            k_bits=args.bits,
            v_bits=args.bits,
            body=args.body,
            max_tokens=n + 1,
        )
        cache = sjkvarn.Cache(cfg)
        k = torch.randn(n, kvh, d, generator=gen)
        v = torch.randn(n, kvh, d, generator=gen)
        cache.append(0, k, v)
        q = torch.randn(1, qh, d, generator=gen)
        kk = k.permute(1, 0, 2).repeat_interleave(qh // kvh, 0)[None]
        vv = v.permute(1, 0, 2).repeat_interleave(qh // kvh, 0)[None]
        qq = q.permute(1, 0, 2)[None]
        ours = median_time(lambda: cache.attend(0, q), args.repeats)  # noqa: B023
        theirs = median_time(
            lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv),  # noqa: B023
            args.repeats,
        )
        bits = cache.memory()["effective_bits"]
        row = f"{n:>8} {ours * 1e3:>11.2f} {theirs * 1e3:>13.2f} {ours / theirs:>7.2f}"
        print(f"{row} {bits:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
