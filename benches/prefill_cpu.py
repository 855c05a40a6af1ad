"""CPU chunked prefill: a chunk of query rows against a filled cache vs torch SDPA, side by side.

One layer (24 query heads over 4 KV heads of 256 by default) holds `--context` random tokens;
the last `--chunk` of them are the query rows (causal), as in a chunked prefill step. SDPA runs
in float32 over the same K/V expanded per query head, with the causal mask of those rows, and,
when the chunk is the whole context (a first chunk, where SDPA's ``is_causal`` expresses the
mask), also with ``is_causal=True``. Alternates the calls and reports medians. Threads:
`RAYON_NUM_THREADS` and `OMP_NUM_THREADS` (set both for a fair comparison).

Usage: RAYON_NUM_THREADS=2 OMP_NUM_THREADS=2 python benches/prefill_cpu.py [--context 16384]
           [--chunk 4096] [--geometry 24/4/256] [--repeats 3]
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

    def sdpa_is_causal() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

    def ours() -> torch.Tensor:
        return cache.attend(0, q)

    calls = {"sjkvarn": ours, "SDPA fp32, boolean mask": sdpa}
    if chunk == n:
        calls["SDPA fp32, is_causal"] = sdpa_is_causal
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ours_s = medians.pop("sjkvarn")
    print(
        f"prefill {chunk} rows over {n} tokens, {args.geometry}, torch threads "
        f"{torch.get_num_threads()}: sjkvarn {ours_s * 1e3:.0f} ms; "
        + "; ".join(f"{k} {s * 1e3:.0f} ms (ratio {ours_s / s:.2f})" for k, s in medians.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
