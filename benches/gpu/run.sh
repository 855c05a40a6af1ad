#!/usr/bin/env bash
# The GPU check, for a GPU machine with no network and no Rust toolchain.
#
# Here (a CPU machine with the toolchain): bash benches/gpu/build_wheel.sh
# There:                                   bash benches/gpu/run.sh [OUT_DIR]
#
# Installs the abi3 wheel from benches/gpu/wheels/ (git-ignored) into a private folder, runs the
# CUDA tests (device vs CPU) and benches/gpu/gpu_check.py, and leaves gpu_check.json and the logs
# in OUT_DIR (default: $OUT, else benches/gpu/out). Needs python3 with torch, numpy and pytest.
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
timeout 400 python3 "$here/gpu_check.py" --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log" || status=1
exit $status
