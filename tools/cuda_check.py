"""Compile every sjkvarn CUDA kernel with NVRTC and check it with `ptxas -v`, on a machine
without a GPU.

Installs the pinned CUDA 13.0-line NVRTC and nvcc (for ptxas) wheels into an isolated folder,
builds the `sjkvarn-cuda-ptx` binary (feature `cuda`), compiles the kernels for each
architecture, runs `ptxas -v` and prints registers, spills, stack and shared memory per
kernel. Exits non-zero on a compile error or on any spill in an attention kernel (the decode
path). Usage: python tools/cuda_check.py [--arch sm_90 --arch sm_86] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The target H200's driver is CUDA 13.0: compile with the same line.
WHEELS = ["nvidia-cuda-nvrtc==13.0.*", "nvidia-cuda-nvcc==13.0.*"]
DECODE_PREFIX = "sj_attend_"


def install_tools(folder: Path) -> Path:
    """Pinned wheels in `folder` (reused when present); returns their `nvidia/cu13`."""
    cu13 = folder / "nvidia" / "cu13"
    if not (cu13 / "lib" / "libnvrtc.so.13").exists() or not (cu13 / "bin" / "ptxas").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--upgrade",
                "--target",
                str(folder),
                *WHEELS,
            ],
            check=True,
        )
    return cu13


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per kernel: registers, spill stores/loads, stack frame and shared memory bytes."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            kernels[current] = {
                "registers": 0,
                "spill_stores": 0,
                "spill_loads": 0,
                "stack": 0,
                "smem": 0,
            }
            continue
        if current is None:
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            k = kernels[current]
            k["stack"], k["spill_stores"], k["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[current]["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            kernels[current]["smem"] = int(s.group(1)) if s else 0
    return kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="sm_XX (default: sm_90 and sm_86)")
    ap.add_argument("--tools", default=str(ROOT / "target" / "cuda-tools"))
    ap.add_argument("--json", default=str(ROOT / "target" / "cuda-check.json"))
    args = ap.parse_args()
    arches = args.arch or ["sm_90", "sm_86"]
    cu13 = install_tools(Path(args.tools))
    env = dict(os.environ)
    # libnvrtc finds its builtins library only through the loader path.
    env["LD_LIBRARY_PATH"] = f"{cu13 / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    out = ROOT / "target" / "cuda-ptx"
    env["SJKVARN_KERNEL_CACHE"] = str(out / "cache-disabled")
    for p in (out / "cache-disabled").glob("*.ptx") if (out / "cache-disabled").exists() else []:
        p.unlink()  # always compile afresh here
    virtual = [a.replace("sm_", "compute_") for a in arches]
    build = subprocess.run(
        [
            "cargo",
            "run",
            "--quiet",
            "--release",
            "-p",
            "sjkvarn",
            "--features",
            "cuda",
            "--bin",
            "sjkvarn-cuda-ptx",
            "--",
            str(out),
            *virtual,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    print(build.stdout, end="")
    if build.returncode != 0:
        print(build.stderr, file=sys.stderr)
        print("FAIL: NVRTC could not compile the kernels", file=sys.stderr)
        return 1
    report: dict[str, dict[str, dict[str, int]]] = {}
    failures = []
    for arch, virt in zip(arches, virtual, strict=True):
        ptx = out / f"sjkvarn-{virt}.ptx"
        res = subprocess.run(
            [str(cu13 / "bin" / "ptxas"), "-v", f"-arch={arch}", str(ptx), "-o", os.devnull],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            failures.append(f"{arch}: ptxas failed")
            continue
        kernels = parse_ptxas(res.stderr + res.stdout)
        report[arch] = kernels
        print(f"\n{arch}: {len(kernels)} kernels")
        header = ("kernel", "regs", "spill st", "spill ld", "stack", "smem")
        print("  {:<20} {:>5} {:>9} {:>9} {:>6} {:>6}".format(*header))
        for name, k in sorted(kernels.items()):
            print(
                f"  {name:<20} {k['registers']:>5} {k['spill_stores']:>9} {k['spill_loads']:>9}"
                f" {k['stack']:>6} {k['smem']:>6}"
            )
            if name.startswith(DECODE_PREFIX) and (k["spill_stores"] or k["spill_loads"]):
                failures.append(f"{arch} {name}: spills in the decode kernel")
        if not kernels:
            failures.append(f"{arch}: ptxas reported no kernels")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
