"""CPU decode attention over the compressed cache vs torch SDPA over dense K/V, side by side.

For each geometry, context length and body, one layer is filled with random K/V, then one
decode query is timed, alternating in one process between: sjkvarn `Cache.attend`; torch SDPA
over the same K/V in float32 and in bfloat16 with the query heads of a KV head folded into the
query axis (GQA: each K/V row is read once, as sjkvarn reads it); and a plain read of as many
bytes as sjkvarn's call touches (sink + the records it scores + the ring rows: the bandwidth
limit). The thread counts alternate in the same loop, call by call (`Cache.attend(threads=N)`
and `torch.set_num_threads(N)` before each torch call), in one process started with the largest
count (`RAYON_NUM_THREADS`, and `OMP_WAIT_POLICY=PASSIVE` so that idle OpenMP threads do not spin
on the second core): this guest's speed wanders by 20-40% between minutes, so thread counts
timed minutes apart in separate processes gave speed-ups that moved by as much. Reports medians
and ratios from that one alternating run.

Usage: python benches/attention_cpu.py [--tokens 4096 16384 32768 65536] [--threads 1 2]
           [--geometry 24/4/256 9/3/64] [--bodies 4/4 3/2t] [--repeats 15]
           [--journals default q8_0/tq6_0 reference]

``--journals``: ``default`` is ``Config()``'s journal, ``reference`` ``Config.reference()``'s,
and a staging spec (``q8_0/tq6_0``, optionally ``+centred``) that staging over the default
tails, keys as appended unless ``+centred``; any of them with ``+wN`` reads the newest ``N``
positions from exact copies (``exact_recent``); several run side by side in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _journal(spec: str) -> dict[str, object]:
    """``Config`` fields of a ``--journals`` entry."""
    import sjkvarn

    parts = spec.split("+")
    window = [p for p in parts if p.startswith("w") and p[1:].isdigit()]
    extra = {"exact_recent": int(window[0][1:])} if window else {}
    parts = [p for p in parts if p not in window]
    if parts == ["default"]:
        return extra
    if parts == ["reference"]:
        return {**sjkvarn.cache.REFERENCE_JOURNAL, **extra}
    return dict(staging=parts[0], centre_keys="centred" in parts[1:], **extra)


def _one_process(args: argparse.Namespace) -> list[dict[str, object]]:
    import torch

    import sjkvarn
    import sjkvarn.memory

    rows = []
    for geometry in args.geometry:
        qh, kvh, d = (int(x) for x in geometry.split("/"))
        gs = qh // kvh
        for body_name, journal in [(b, j) for b in args.bodies for j in args.journals]:
            trellis = body_name.endswith("t")
            kb, vb = (int(x) for x in body_name.rstrip("t").split("/"))
            for n in args.tokens:
                gen = torch.Generator().manual_seed(n)
                cfg = sjkvarn.Config(
                    layers=1,
                    kv_heads=kvh,
                    q_heads=qh,
                    head_dim=d,
                    k_bits=kb,
                    v_bits=vb,
                    body="trellis" if trellis else "scalar",
                    max_tokens=n + 1,
                    **_journal(journal),  # type: ignore[arg-type]
                )
                cache = sjkvarn.Cache(cfg)
                k = torch.randn(n, kvh, d, generator=gen)
                v = torch.randn(n, kvh, d, generator=gen)
                cache.append(0, k, v)
                q = torch.randn(1, qh, d, generator=gen)
                # GQA folded: [1, kv_heads, group size, d] queries over [1, kv_heads, n, d].
                qf = q[0].reshape(kvh, gs, d)[None]
                kf = k.permute(1, 0, 2)[None].contiguous()
                vf = v.permute(1, 0, 2)[None].contiguous()
                qb, kbf, vbf = qf.bfloat16(), kf.bfloat16(), vf.bfloat16()
                m = cache.memory()
                k_kind, _, v_kind = cache.config.staging.partition("/")
                entry = sjkvarn.memory.staging_row_bytes(d, k_kind)
                entry += sjkvarn.memory.staging_row_bytes(d, v_kind or k_kind)
                read = (
                    m["sink_tokens"] * kvh * d * 4
                    + m["body_bytes"]
                    + m["ring_tokens"] * kvh * entry
                )
                raw = torch.rand(max(read // 4, 1), generator=gen)  # float32: a vectorised sum
                sdpa = torch.nn.functional.scaled_dot_product_attention
                calls = {
                    "sjkvarn": lambda t: cache.attend(0, q, threads=t),  # noqa: B023
                    "sdpa_fp32": lambda t: sdpa(qf, kf, vf),  # noqa: B023
                    "sdpa_bf16": lambda t: sdpa(qb, kbf, vbf),  # noqa: B023
                    "read_bytes": lambda t: raw.sum(),  # noqa: B023
                }
                runs = [(t, name) for t in args.threads for name in calls]
                times: dict[tuple[int, str], list[float]] = {run: [] for run in runs}
                for t, name in runs:
                    torch.set_num_threads(t)
                    calls[name](t)
                for _ in range(args.repeats):
                    for t, name in runs:
                        torch.set_num_threads(t)
                        start = time.perf_counter()
                        calls[name](t)
                        times[(t, name)].append(time.perf_counter() - start)
                fewest = min(args.threads)
                for t in args.threads:
                    med = {name: statistics.median(times[(t, name)]) for name in calls}
                    # Paired: each round's fewest-thread call over its own call at t threads,
                    # timed a few milliseconds apart, so the guest's drift cancels.
                    paired = [
                        a / b
                        for a, b in zip(
                            times[(fewest, "sjkvarn")], times[(t, "sjkvarn")], strict=True
                        )
                    ]
                    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
                    rows.append(
                        dict(
                            geometry=geometry,
                            body=body_name,
                            journal=journal,
                            tokens=n,
                            threads=t,
                            bytes_read=read,
                            bits_per_value=m["effective_bits"],
                            **{f"{name}_ms": 1e3 * ms for name, ms in med.items()},
                            paired_speedup=statistics.median(paired),
                            paired_speedup_q1=quartiles[0],
                            paired_speedup_q3=quartiles[2],
                        )
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--geometry", nargs="+", default=["24/4/256", "9/3/64"])
    p.add_argument("--bodies", nargs="+", default=["4/4", "3/2t"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--journals", nargs="+", default=["default"])
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_one_process(args)))
        return 0
    if min(args.threads) < 1:
        p.error("--threads must be at least 1")
    most = max(args.threads)
    argv = [sys.argv[0], "--worker", "--threads", *map(str, args.threads)]
    argv += ["--repeats", str(args.repeats), "--tokens", *map(str, args.tokens)]
    argv += ["--geometry", *args.geometry, "--bodies", *args.bodies, "--journals", *args.journals]
    # OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads otherwise spin for a while after
    # each SDPA call and take the core that sjkvarn's second thread is about to use.
    env = dict(
        os.environ,
        RAYON_NUM_THREADS=str(most),
        OMP_NUM_THREADS=str(most),
        OMP_WAIT_POLICY="PASSIVE",
    )
    done = subprocess.run(
        [sys.executable, *argv], env=env, stdout=subprocess.PIPE, text=True, check=True
    )
    rows: list[dict[str, object]] = json.loads(done.stdout)
    print(
        f"{'geometry':>9} {'body':>5} {'journal':>18} {'tokens':>7} {'thr':>3} {'sjkvarn ms':>10} "
        f"{'fp32 ms':>8} {'bf16 ms':>8} {'read ms':>8} {'/fp32':>6} {'/bf16':>6} "
        f"{'GB/s':>6} {'% of read':>9} {'bits':>5}"
    )
    for r in rows:
        ours = float(r["sjkvarn_ms"])  # type: ignore[arg-type]
        gbs = float(r["bytes_read"]) / (ours * 1e-3) / 1e9  # type: ignore[arg-type]
        limit = float(r["read_bytes_ms"])  # type: ignore[arg-type]
        print(
            f"{r['geometry']:>9} {r['body']:>5} {r['journal']:>18} {r['tokens']:>7} "
            f"{r['threads']:>3} {ours:>10.2f} "
            f"{r['sdpa_fp32_ms']:>8.2f} {r['sdpa_bf16_ms']:>8.2f} {limit:>8.2f} "
            f"{ours / float(r['sdpa_fp32_ms']):>6.2f} {ours / float(r['sdpa_bf16_ms']):>6.2f} "  # type: ignore[arg-type]
            f"{gbs:>6.2f} {100 * limit / ours:>8.1f}% {float(r['bits_per_value']):>5.2f}"  # type: ignore[arg-type]
        )
    if 1 in args.threads and 2 in args.threads:
        print(
            "\nsjkvarn 2-thread speed-up: 1-thread median / 2-thread median; per-round pairs "
            "(1-thread call / the same round's 2-thread call): median [quartiles]"
        )
        by_key = {(r["geometry"], r["body"], r["journal"], r["tokens"]): {} for r in rows}
        for r in rows:
            key = (r["geometry"], r["body"], r["journal"], r["tokens"])
            by_key[key][r["threads"]] = r  # type: ignore[index]
        for (g, b, j, n), t in by_key.items():
            one, two = t[1], t[2]
            ratio = float(one["sjkvarn_ms"]) / float(two["sjkvarn_ms"])
            print(
                f"  {g} {b} {j} {n}: {ratio:.2f}; pairs {two['paired_speedup']:.2f} "
                f"[{two['paired_speedup_q1']:.2f}, {two['paired_speedup_q3']:.2f}]"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
