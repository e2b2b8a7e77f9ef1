#!/usr/bin/env bash
# Create a virtual environment (Python >= 3.11) and install sglang-m3 into it, with SGLang pinned to
# one release of the supported range (0.5.16 through 0.5.23).
#   ./scripts/setup.sh                                            .venv, SGLang 0.5.16, test+eval+amd extras
#   VENV=.venv-0523 SGLANG_VERSION=0.5.23 EXTRAS=test ./scripts/setup.sh   SGLang 0.5.23 (CPU tests only)
# SGLang 0.5.16 brings torch 2.11 and Triton 3.6 (the H200 image's torch); 0.5.23 brings torch 2.14.1.
# The first run downloads several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.16}"
EXTRAS="${EXTRAS:-test,eval,amd}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" "sglang==$SGLANG_VERSION"
