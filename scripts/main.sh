#!/usr/bin/env bash
# Main job on the bundled default: what each index-K format costs and keeps (CPU, seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m m3_kernels.formats.report "$@"
