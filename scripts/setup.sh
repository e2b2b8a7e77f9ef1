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
step() { echo "setup.sh [$(date +%H:%M:%S)] $*"; }
if [ ! -x "$VENV/bin/python" ]; then
    step "1/3 creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
else
    step "1/3 $VENV exists"
fi
step "2/3 upgrading pip"
"$VENV/bin/python" -m pip install -q --upgrade pip
# pip's own lines (Collecting, Downloading, Installing) are the progress of the long step: no -q here
step "3/3 installing sglang-m3 [$EXTRAS] and SGLang $SGLANG_VERSION (a few minutes and several GB the first time)"
"$VENV/bin/python" -m pip install --progress-bar on -e ".[$EXTRAS]" "sglang==$SGLANG_VERSION"
step "done: $("$VENV/bin/python" -c 'import sglang; print("SGLang", sglang.__version__)') in $VENV"
