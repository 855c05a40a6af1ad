#!/usr/bin/env bash
# Builds what the GPU check installs (benches/gpu/wheels/, git-ignored): the abi3 wheel, and the
# Rust CUDA test binaries (crates/sjkvarn/tests/cuda_*.rs, feature `cuda`) in wheels/tests/,
# because the GPU machine has no Rust toolchain.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
rm -rf "$here/wheels"
cd "$here/../.." && maturin build --release --features fault-injection -o "$here/wheels"
mkdir -p "$here/wheels/tests"
cargo test --release -p sjkvarn --features cuda --test cuda_faults --test cuda_probe --no-run \
    --message-format=json |
  python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
' "$here/wheels/tests"
ls -la "$here/wheels" "$here/wheels/tests"
