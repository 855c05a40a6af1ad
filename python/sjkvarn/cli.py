"""The ``sjkvarn`` command.

``sjkvarn`` (or ``sjkvarn formats``) prints every format's size and its error on seeded
Gaussian and Student-t tiles.
"""

from __future__ import annotations

import argparse
import sys

from sjkvarn import memory, report
from sjkvarn.memory import KNOWN_MODELS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sjkvarn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    fmt = sub.add_parser("formats", help="format sizes and error tables on synthetic tiles")
    fmt.add_argument("--seed", type=int, default=20261129)
    fmt.add_argument("--tiles", type=int, default=16, help="128-token tiles per distribution")
    fmt.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256, 512])
    mem = sub.add_parser("memory", help="cache allocation per format and the largest context")
    mem.add_argument("--model", help="known model: " + ", ".join(KNOWN_MODELS))
    mem.add_argument("--layers", type=int)
    mem.add_argument("--kv-heads", type=int)
    mem.add_argument("--head-dim", type=int)
    mem.add_argument("--context", type=int, default=110_592)
    mem.add_argument("--budget-gb", type=float, default=None, help="find the largest context")
    args = parser.parse_args(argv)
    if args.command == "memory":
        try:
            geo = memory.geometry(args.model, args.layers, args.kv_heads, args.head_dim)
        except ValueError as e:
            parser.error(str(e))
        if args.context < 1:
            parser.error("--context must be at least 1")
        print(f"{geo.layers} full-attention layers x {geo.kv_heads} KV heads x {geo.head_dim}")
        print(
            memory.render(
                memory.table(geo, args.context, args.budget_gb), args.context, args.budget_gb
            )
        )
        return 0
    if args.command in (None, "formats"):
        seed = getattr(args, "seed", 20261129)
        tiles = getattr(args, "tiles", 16)
        head_dim = getattr(args, "head_dim", 128)
        if tiles < 1:
            parser.error("--tiles must be at least 1")
        dists = report.synthetic_tiles(seed, tiles, head_dim)
        print(f"normalised MSE on {tiles} seeded tiles of 128 tokens x {head_dim} channels")
        print(report.render(report.error_table(dists)))
        return 0
    parser.print_help(sys.stderr)
    return 2
