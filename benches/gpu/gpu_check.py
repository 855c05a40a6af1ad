"""The GPU check: device-vs-CPU parity, decode attention against torch SDPA, seal time.

Runs on a GPU machine with no network and no Rust toolchain (``benches/gpu/run.sh`` installs the
wheel built elsewhere first) and writes one JSON. ``--dry-run`` runs the same code on the CPU
backend at small sizes, to check the script anywhere.

Measured, side by side in one run:
- parity: a device cache and a CPU cache fed the same tokens hold the same snapshot bytes
  (scalar and trellis records, ring, sink), and their attention agrees within 1e-3 relative;
- decode attention (one query row, batch 1, 4/4 scalar) at 8K, 32K and 128K tokens for
  24 q / 4 KV heads at D=256 and 32 q / 8 KV heads at D=128, against
  ``torch.nn.functional.scaled_dot_product_attention`` over bf16 K/V, L2 flushed between calls;
  also as compressed bytes read per second against the measured device copy bandwidth;
- seal: ``seal_idle()`` of a 4,096-token batch in every layer of the Qwen3.8-27B geometry
  (16 layers x 4 KV heads, D=256), 4/4 scalar and 3/3 trellis.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import sjkvarn
from sjkvarn import Cache, Config


class Timer:
    """Median wall time of a call, by CUDA events on the GPU and perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def median_ms(self, fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.flush is not None:
                self.flush.zero_()  # evict the L2 (60 MB on an H200) between calls
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(device: str, timer: Timer) -> float:
    """Device-to-device copy, bytes read plus written per second."""
    n = (2 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src), reps=10)
    return 2 * n / (ms / 1e3)


def filled(cfg: Config, tokens: int, device: str, seed: int) -> Cache:
    """A one-sequence cache holding `tokens` random post-RoPE-like tokens in every layer."""
    cache = Cache(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    done = 0
    while done < tokens:
        n = min(cfg.max_chunk * 8, tokens - done)
        for layer in range(cfg.layers):
            k = torch.randn(n, cfg.kv_heads, cfg.head_dim, generator=gen, device=device)
            k[:, :, 3] *= 10.0
            v = torch.randn(n, cfg.kv_heads, cfg.head_dim, generator=gen, device=device)
            cache.append(layer, k, v)
        done += n
    return cache


def compressed_bytes(cache: Cache, cfg: Config) -> int:
    """Bytes attention reads for one layer: sink, body records, ring rows."""
    m = cache.memory()
    per_layer_body = m["body_bytes"] / cfg.layers
    sink = min(cache.length(0), 128) * cfg.kv_heads * cfg.head_dim * 2 * 2
    ring_row = (cfg.head_dim // min(cfg.head_dim, 128)) * (2 + min(cfg.head_dim, 128) * 6 // 8)
    ring = (m["ring_tokens"] / cfg.layers) * cfg.kv_heads * 2 * ring_row
    return int(sink + per_layer_body + ring)


def parity(device: str, dry: bool) -> list[dict[str, Any]]:
    """Device cache vs CPU cache on the same tokens: snapshot bytes and attention."""
    results = []
    cases = [
        ("scalar", 4, 4, 256, 24, 4),
        ("scalar", 3, 2, 128, 32, 8),
        ("trellis", 3, 3, 128, 32, 8),
    ]
    tokens = 1500 if dry else 8192
    for body, kb, vb, d, qh, kvh in cases:
        cfg = dict(
            layers=1,
            kv_heads=kvh,
            q_heads=qh,
            head_dim=d,
            k_bits=kb,
            v_bits=vb,
            body=body,
            min_tail=512,
            max_tail=1024,
            max_chunk=256,
            max_tokens=tokens + 64,
            staging="tq6_0",  # the device ring's type (the CPU default keeps keys in q8_0)
        )
        gen = torch.Generator().manual_seed(d + kb)
        cpu, dev = Cache(Config(**cfg)), Cache(Config(**cfg, device=device))
        done = 0
        while done < tokens:
            n = min(700, tokens - done)
            k = torch.randn(n, kvh, d, generator=gen)
            k[:, :, 3] *= 10.0
            v = torch.randn(n, kvh, d, generator=gen)
            cpu.append(0, k, v)
            dev.append(0, k.to(device), v.to(device))
            done += n
        q = torch.randn(4, qh, d, generator=gen)
        want = cpu.attend(0, q)
        got = dev.attend(0, q.to(device)).cpu()
        err = float((got - want).abs().max() / want.abs().max())
        same = dev.snapshot() == cpu.snapshot()
        results.append(
            {
                "body": body,
                "bits": f"{kb}/{vb}",
                "head_dim": d,
                "tokens": tokens,
                "snapshot_identical": same,
                "attention_max_rel_err": err,
                "ok": same and err < 1e-3,
            }
        )
        print(f"parity {body} {kb}/{vb} D={d}: snapshot identical {same}, attention err {err:.2e}")
    return results


def decode_bench(device: str, timer: Timer, bandwidth: float, dry: bool) -> list[dict[str, Any]]:
    results = []
    lengths = [2048, 4096] if dry else [8192, 32768, 131072]
    for qh, kvh, d in [(24, 4, 256), (32, 8, 128)]:
        for length in lengths:
            cfg = Config(
                layers=1,
                kv_heads=kvh,
                q_heads=qh,
                head_dim=d,
                k_bits=4,
                v_bits=4,
                max_tokens=length + 64,
                device=device,
            )
            t0 = time.perf_counter()
            cache = filled(cfg, length, device, seed=length + d)
            fill_s = time.perf_counter() - t0
            q = torch.randn(1, qh, d, device=device)
            ours = timer.median_ms(partial(cache.attend, 0, q), reps=5 if dry else 50)
            qb = q.to(torch.bfloat16).transpose(0, 1).unsqueeze(0)  # [1, qh, 1, d]
            kb = torch.randn(1, kvh, length, d, device=device, dtype=torch.bfloat16)
            vb = torch.randn_like(kb)
            sdpa_call = partial(
                torch.nn.functional.scaled_dot_product_attention, qb, kb, vb, enable_gqa=True
            )
            sdpa = timer.median_ms(sdpa_call, reps=5 if dry else 50)
            read = compressed_bytes(cache, cfg)
            achieved = read / (ours / 1e3)
            row = {
                "q_heads": qh,
                "kv_heads": kvh,
                "head_dim": d,
                "tokens": length,
                "sjkvarn_ms": ours,
                "sdpa_bf16_ms": sdpa,
                "speedup_vs_sdpa": sdpa / ours,
                "compressed_bytes": read,
                "bf16_bytes": 2 * kb.numel() * 2,
                "achieved_bytes_per_s": achieved,
                "fraction_of_copy_bandwidth": achieved / bandwidth,
                "effective_bits": cache.memory()["effective_bits"],
                "fill_s": fill_s,
            }
            results.append(row)
            print(
                f"decode {qh}/{kvh} D={d} {length:>6} tokens: sjkvarn {ours:.3f} ms, "
                f"SDPA bf16 {sdpa:.3f} ms ({sdpa / ours:.2f}x), {achieved / 1e9:.0f} GB/s "
                f"= {achieved / bandwidth:.0%} of copy bandwidth"
            )
            del cache, kb, vb
    return results


def seal_bench(device: str, dry: bool) -> list[dict[str, Any]]:
    """seal_idle() of one 4,096-token batch in every layer (Qwen3.8-27B geometry)."""
    results = []
    layers, kvh, d = (2, 2, 128) if dry else (16, 4, 256)
    batch = 512 if dry else 4096
    for body, kb, vb in [("scalar", 4, 4), ("trellis", 3, 3)]:
        cfg = Config(
            layers=layers,
            kv_heads=kvh,
            q_heads=kvh * 6,
            head_dim=d,
            k_bits=kb,
            v_bits=vb,
            body=body,
            min_tail=batch,
            max_tail=2 * batch,
            max_chunk=512,
            max_tokens=4 * batch,
            device=device,
        )
        cache = filled(cfg, 128 + 2 * batch, device, seed=kb)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.seal_idle()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        sealed = cache.regions(0)["body"]
        results.append(
            {
                "body": body,
                "bits": f"{kb}/{vb}",
                "layers": layers,
                "kv_heads": kvh,
                "head_dim": d,
                "tokens_per_layer": sealed[1] - sealed[0],
                "ms": ms,
            }
        )
        print(
            f"seal {body} {kb}/{vb}: {sealed[1] - sealed[0]} tokens x {layers} layers "
            f"in {ms:.1f} ms"
        )
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, small sizes")
    args = ap.parse_args()
    status = sjkvarn.cuda_available()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not status:
        print(f"no CUDA: {status.reason}", file=sys.stderr)
        return 2
    print(f"backend: {status.reason if not args.dry_run else 'cpu (dry run)'}")
    timer = Timer(device)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": status.reason if not args.dry_run else "cpu (dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dry_run": args.dry_run,
    }
    report["copy_bandwidth_bytes_per_s"] = copy_bandwidth(device, timer)
    print(f"copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (read + write)")
    report["parity"] = parity(device, args.dry_run)
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    report["decode"] = decode_bench(device, timer, bandwidth, args.dry_run)
    report["seal"] = seal_bench(device, args.dry_run)
    report["wall_s"] = time.perf_counter() - started
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.json} in {report['wall_s']:.0f} s")
    return 0 if all(p["ok"] for p in report["parity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
