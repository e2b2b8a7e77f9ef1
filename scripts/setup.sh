#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install sglang-m3 with its test, eval and AMD (FlyDSL) extras.
# SGLang 0.5.16 brings torch 2.11 and Triton 3.6; the first run downloads several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,eval,amd]"
