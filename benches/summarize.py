"""Turns `cargo bench -p sjkvarn --bench codec` output into docs/results/codec.md's tables.

Usage:
    cargo bench -p sjkvarn --bench codec -- --quick | tee bench.txt
    python benches/summarize.py bench.txt
"""

from __future__ import annotations

import re
import sys

SCALE = {"elem/s": 1.0, "Kelem/s": 1e3, "Melem/s": 1e6, "Gelem/s": 1e9}


def parse(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """Median throughput per (group, item) and operation."""
    results: dict[tuple[str, str], dict[str, float]] = {}
    current: tuple[str, str, str] | None = None
    for line in text.splitlines():
        head = re.match(r"^(flat|body_seal)/(\w+)/(\S+)", line)
        if head:
            current = (head[1], head[2], head[3])
            continue
        thrpt = re.match(r"^\s+thrpt:\s+\[\S+\s+\S+\s+(\S+)\s+(\S+)", line)
        if thrpt and current:
            group, op, item = current
            results.setdefault((group, item), {})[op] = float(thrpt[1]) * SCALE[thrpt[2]]
            current = None
    return results


def render(results: dict[tuple[str, str], dict[str, float]]) -> str:
    lines = ["| format | encode (M values/s) | decode (M values/s) |", "|---|---:|---:|"]
    for (group, item), ops in results.items():
        if group == "flat":
            lines.append(f"| {item} | {ops['encode'] / 1e6:.0f} | {ops['decode'] / 1e6:.0f} |")
    lines += [
        "",
        "| scalar body record (K+V, one head, 128 tokens) | seal (tiles/s) | decode (tiles/s) |",
        "|---|---:|---:|",
    ]
    for (group, item), ops in results.items():
        if group == "body_seal":
            m = re.match(r"d(\d+)_k(\d)v(\d)", item)
            assert m, item
            lines.append(f"| D={m[1]}, {m[2]}/{m[3]} | {ops['encode']:.0f} | {ops['decode']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(parse(f.read())))
