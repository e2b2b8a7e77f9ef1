#!/usr/bin/env bash
# Train the small MSA model (lab/training/train.py, config lab/training/configs/msa-small.json) on an H200.
#
# Runs on the GPU machine from the repo root. Needs torch, tokenizers and safetensors: the image has
# them; if not, the carried SGLang wheel bundle (.whl1/, see build_wheel_bundle.sh) is unpacked by
# lab/gpu/bundle_env.sh. The run directory $RUN_DIR (default build/msa-train, git-ignored, so
# it stays on the machine between calls while the machine is held) gets the exact-resume
# checkpoint ckpt/state.pt (about 190 MB for msa-small: too big to come back), train.log,
# metrics.jsonl and export/. The device returns at most 8 files of at most 16 MiB (64 MiB in all), so
# $OUT (default out/msa-train) gets at most 8: call.log (everything this call printed, the trainer's
# log lines included), metrics.jsonl (the whole run so far; its last 15 MiB if longer), and the
# export (bf16 safetensors + config + tokenizer + trainer_state.json) as a gzipped tar in 15 MiB parts
# export.tgz.part-aa, -ab, ... (at most 6; rebuild with `cat export.tgz.part-* | tar -xz`, giving
# export/). If the export would need more parts it is left out and call.log says so.
#
#   lab/gpu/train_msa_h200.sh [train.py args]               # a new run (plan args go here)
#   RESUME=build/msa-train lab/gpu/train_msa_h200.sh        # exact: same machine, still held
#   RESUME=<dir with export/> lab/gpu/train_msa_h200.sh     # from a returned export: plan and
#                                                               # step continue, optimizer restarts
# Env: BUDGET_S (default 540: seconds for this script; the trainer stops stepping 60 s before its
# share ends, then checkpoints, exports and evaluates; then a probe (at most 50 s) and packing; call
# it with a 600 s limit), CONFIG, RUN_DIR, OUT, MAX_EXPORT_PARTS (default 6).
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
OUT="${OUT:-out/msa-train}"
RUN_DIR="${RUN_DIR:-build/msa-train}"
BUDGET_S="${BUDGET_S:-540}"
CONFIG="${CONFIG:-lab/training/configs/msa-small.json}"
mkdir -p "$OUT" "$RUN_DIR"
exec > >(tee -a "$OUT/call.log") 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

if ! python3 -c "import torch, tokenizers, safetensors" 2>/dev/null; then
    echo "tokenizers/safetensors missing: using the carried bundle"
    source lab/gpu/bundle_env.sh || exit 1
fi
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, tokenizers, safetensors, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, 'tokenizers', tokenizers.__version__, 'safetensors', safetensors.__version__, \
'cuda', torch.cuda.is_available())" || exit 1

left=$(( BUDGET_S - ($(date +%s) - t0) ))
args=(--out "$RUN_DIR" --budget-s "$(( left - 75 ))")
if [ -n "${RESUME:-}" ]; then
    args+=(--resume "$RESUME")
else
    args+=(--config "$CONFIG")
fi
# The hard stop leaves time to pack the results even if the trainer overruns its own budget.
timeout --signal=TERM --kill-after=10 "$(( left - 60 ))" python3 -m training.train "${args[@]}" "$@"
rc=$?
# Where retrieval stands (training.probe: digit accuracy of first / repeated questions, key-word copy
# loss, with chance levels), on the CPU cores so a stuck GPU cannot hold the packing step.
timeout 50 python3 -m training.probe "$RUN_DIR" --length 1024 --samples 48 || echo "probe failed or timed out"

if [ -f "$RUN_DIR/metrics.jsonl" ]; then
    tail -c 15728640 "$RUN_DIR/metrics.jsonl" > "$OUT/metrics.jsonl"
fi
if [ -d "$RUN_DIR/export" ]; then
    tmp=$(mktemp -d)
    tar -C "$RUN_DIR" -czf - export | split -b 15m - "$tmp/export.tgz.part-"
    parts=$(ls "$tmp" | wc -l)
    if [ "$parts" -le "${MAX_EXPORT_PARTS:-6}" ]; then
        mv "$tmp"/export.tgz.part-* "$OUT/"
    else
        echo "export needs $parts parts of 15 MiB (at most ${MAX_EXPORT_PARTS:-6} fit the 8 returned files): left out"
    fi
    rm -rf "$tmp"
fi
ls -l "$OUT"
n=$(ls "$OUT" | wc -l)
echo "train_msa_h200: exit $rc after $(( $(date +%s) - t0 )) s; $n files in \$OUT (at most 8 come back)"
exit "$rc"
