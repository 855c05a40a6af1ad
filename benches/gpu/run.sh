#!/usr/bin/env bash
# The GPU check, for a GPU machine with no network and no Rust toolchain.
#
# Here (a CPU machine with the toolchain): bash benches/gpu/build_wheel.sh
# There:                                   bash benches/gpu/run.sh [OUT_DIR]
#
# Installs the abi3 wheel from benches/gpu/wheels/ (git-ignored) into a private folder, runs the
# CUDA tests (device vs CPU), the Rust CUDA tests built by build_wheel.sh (wheels/tests/: the
# GPU-only ones are #[ignore]d elsewhere, so they run here with --include-ignored) and
# benches/gpu/gpu_check.py, and leaves gpu_check.json and the logs in OUT_DIR (default: $OUT,
# else benches/gpu/out). Needs python3 with torch (whose CUDA wheels bring NVRTC), numpy, pytest.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-${OUT:-$here/out}}"
mkdir -p "$out"
site="$(mktemp -d)"
wheel=$(ls "$here"/wheels/sjkvarn-*.whl 2>/dev/null | head -n1)
if [ -z "$wheel" ]; then
  echo "no wheel in $here/wheels: run benches/gpu/build_wheel.sh on a machine with Rust" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" || exit 2
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
export SJKVARN_KERNEL_CACHE="$out/kernel-cache"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
cd "$root"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/pytest.log" || status=1
# The Rust test binaries find NVRTC through the loader path: the pip wheel's folder.
nvrtc="$(python3 -c 'import os, sys
for base in sys.path:
    for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"):
        if os.path.exists(os.path.join(base or ".", sub, "libnvrtc.so.13")):
            print(os.path.abspath(os.path.join(base or ".", sub))); sys.exit()')"
tests=$(ls "$here"/wheels/tests/cuda_* 2>/dev/null)
if [ -z "$tests" ]; then
  echo "no Rust CUDA test binaries in $here/wheels/tests: rerun build_wheel.sh" | tee "$out/rust_cuda.log"
  status=1
fi
for t in $tests; do
  LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 180 "$t" --include-ignored \
    2>&1 | tee -a "$out/rust_cuda.log" || status=1
done
timeout 400 python3 "$here/gpu_check.py" --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log" || status=1
exit $status
