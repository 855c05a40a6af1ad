"""The ``sjkvarn`` command.

``sjkvarn`` (or ``sjkvarn formats``) prints every format's size and its error on seeded
Gaussian and Student-t tiles.
"""

from __future__ import annotations

import argparse
import sys

from sjkvarn import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sjkvarn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    fmt = sub.add_parser("formats", help="format sizes and error tables on synthetic tiles")
    fmt.add_argument("--seed", type=int, default=20261129)
    fmt.add_argument("--tiles", type=int, default=16, help="128-token tiles per distribution")
    fmt.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256, 512])
    args = parser.parse_args(argv)
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
