"""CPU chunked prefill: a chunk of query rows against a filled cache vs torch SDPA, side by side.

One layer (24 query heads over 4 KV heads of 256 by default) holds `--context` random tokens;
the last `--chunk` of them are the query rows (causal), as in a chunked prefill step. SDPA runs
in float32 over the same K/V expanded per query head, with the causal mask of those rows.
Alternates the two calls and reports medians. Threads: `RAYON_NUM_THREADS` and
`OMP_NUM_THREADS` (set both for a fair comparison).

Usage: RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 python benches/prefill_cpu.py [--context 16384]
           [--chunk 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sjkvarn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--geometry", default="24/4/256")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    qh, kvh, d = (int(x) for x in args.geometry.split("/"))
    n, chunk = args.context, args.chunk
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    q = torch.randn(chunk, qh, d, generator=gen)
    cfg = sjkvarn.Config(layers=1, kv_heads=kvh, q_heads=qh, head_dim=d, max_tokens=n + 1)
    cache = sjkvarn.Cache(cfg)
    cache.append(0, k, v)
    gs = qh // kvh
    kk = k.permute(1, 0, 2).repeat_interleave(gs, 0)[None]
    vv = v.permute(1, 0, 2).repeat_interleave(gs, 0)[None]
    qq = q.permute(1, 0, 2)[None]
    mask = torch.ones(chunk, n, dtype=torch.bool).tril(n - chunk)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)

    def ours() -> torch.Tensor:
        return cache.attend(0, q)

    ours(), sdpa()
    t_ours, t_sdpa = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ours()
        t_ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        sdpa()
        t_sdpa.append(time.perf_counter() - start)
    a, b = statistics.median(t_ours), statistics.median(t_sdpa)
    print(
        f"prefill {chunk} rows over {n} tokens, {args.geometry}, torch threads "
        f"{torch.get_num_threads()}: sjkvarn {a * 1e3:.0f} ms, SDPA fp32 causal {b * 1e3:.0f} ms, "
        f"ratio {a / b:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
