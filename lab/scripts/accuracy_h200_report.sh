#!/usr/bin/env bash
# The H200 format comparison's report, rebuilt on any machine from the committed results (serves nothing):
# lab/data/accuracy_h200_resume/state.tgz holds every sample row the H200 calls returned
# (lab/gpu/accuracy_h200.sh, docs/accuracy.md section 5). Writes OUT (default out/accuracy-h200-report):
# report.md (every format the state holds, replicas included, against fp8 on the prompts both have; Tango /
# Rao-Scott intervals, exact McNemar (clustered cells: the exact sign-flip test on the contexts), the discordant
# pairs with task, length and needle depth), results.json, accuracy_vs_length.png.
#
#   lab/scripts/accuracy_h200_report.sh [OUT]
#
# The targets (fp8 and mxfp4 1,000 a cell, the others 100) and settings are the H200 calls' own; a sample
# row the state lacks is simply not paired.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-out/accuracy-h200-report}"
STATE=lab/data/accuracy_h200_resume/state.tgz
PYTHON="${PYTHON:-.venv/bin/python}"
rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$OUT" -xzf "$STATE" acc/samples
# every format the state holds samples of, fp8 (the baseline) first, then in this order, then any other (replicas)
formats="fp8"
for f in mxfp4 mxfp4_rot bf16 dense $(ls "$OUT/acc/samples" | sort); do
    case " $formats " in *" $f "*) continue ;; esac
    [ -n "$(ls "$OUT/acc/samples/$f"/*.jsonl 2>/dev/null)" ] && formats="$formats $f"
done
# The server arguments the H200 calls recorded with fp8's rows (part of a resumed run's identity; nothing is
# served here); a state from before they were recorded takes the attention backend alone.
mapfile -t LAUNCH < <("$PYTHON" -c 'import json, sys
print("\n".join(json.load(open(sys.argv[1])).get("launch_args") or ["--attention-backend", "triton"]))' \
    "$OUT/acc/samples/fp8/run.json")
# shellcheck disable=SC2086
PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m accuracy.run --model configs/msa-medium \
    --formats $formats --baseline fp8 \
    --tasks m3_niah_single m3_niah_multikey m3_kv_64 m3_vt_value --lengths 8192 32768 65536 131072 \
    --samples 100 --format-samples fp8=1000 mxfp4=1000 --chunk 4 --questions 4 --resume --budget-s 0 \
    --out "$OUT/acc" -- "${LAUNCH[@]}" > "$OUT/report.log" 2>&1 \
    || { tail -n 30 "$OUT/report.log"; exit 1; }
mv "$OUT/acc/report.md" "$OUT/acc/results.json" "$OUT/acc/accuracy_vs_length.png" "$OUT/"
rm -rf "$OUT/acc"
echo "wrote $OUT/report.md, results.json and accuracy_vs_length.png"
