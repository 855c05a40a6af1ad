#!/usr/bin/env bash
# Builds the abi3 wheel the GPU check installs (benches/gpu/wheels/, git-ignored).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
rm -rf "$here/wheels"
cd "$here/../.." && maturin build --release -o "$here/wheels"
ls -la "$here/wheels"
