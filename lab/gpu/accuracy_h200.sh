#!/usr/bin/env bash
# One call of the served index-K format comparison on one H200 (issue 17 section 3): m3-accuracy
# (accuracy/run.py --resume) over the long-context tasks for each format, then the per-layer selection
# agreement (accuracy.agreement), then the report. Calls resume: every sample's row is appended as soon
# as its round is done and skipped when the script runs again, so a comparison of ~1000 paired prompts
# per (task, length) spans as many calls as it needs; each call writes the report of what is done.
#
#   lab/gpu/accuracy_h200.sh [MODEL]                         # call 1, and every call on the same held machine
#   RESUME=<dir with state.tgz> lab/gpu/accuracy_h200.sh [MODEL]   # a fresh machine: continue a returned state
#
# MODEL: an exported checkpoint folder (config.json, safetensors, tokenizer); default configs/msa-medium.
# Run from anywhere with a 600 s limit; it takes BUDGET_S (540) seconds wall. Per call:
#   1. m3-accuracy --resume --budget-s: the MAX_FORMATS (1) formats furthest from their targets (fraction
#      done; ties in FORMATS order, so call 1 serves fp8 and call 2 mxfp4: a server start takes 2-3 minutes
#      on an H200, so one a call), one SGLang server each (CUDA graphs on,
#      the launch arguments below), each getting an equal share of the time left; a round (CHUNK samples
#      of every task x length) starts only if it is predicted to fit. fp8 and mxfp4 (LARGE_FORMATS) aim at
#      N_LARGE samples per (task, length), the others at N_SMALL.
#   2. while the agreement is incomplete: accuracy.agreement --reuse, one format at a time (bf16 first:
#      fp8, mxfp4, mxfp4_rot are compared with it and with each other), AGREE_SAMPLES single-needle prompts
#      per length, eager servers (the recorder needs them); it gets AGREE_S of the budget; a format cut
#      short by the budget is served again next call.
#   3. report.md: the paired tables (each format against fp8 on the prompts both have, Tango/Newcombe
#      intervals, exact McNemar; accuracy/report.py), the samples done per cell, the agreement tables.
# State: $RUN_DIR (default build/accuracy-h200, git-ignored; it survives between calls while the machine
# is held): acc/samples/<fmt>/<task>.jsonl + run.json, acc/server-*.log, agreement/formats/<fmt>.{npz,json}.
# $OUT (default out/accuracy-h200) gets at most 8 files, each <= 15 MiB:
#   call.log            everything this call printed
#   state.tgz           acc/samples (the per-sample JSONL) and agreement/formats: the resume state
#   results.json        m3-accuracy's summary (pairs, coverage, run settings)
#   agreement.json      the agreement study's summary (when at least bf16 and one more format are done)
#   logs.tgz            the servers' logs (last 2 MiB of each); files-written.txt (on a GPU): every folder outside
#                       the run directory this call wrote to (lab/gpu/files_written.py);
#                       bench-bench_sparse_{prefill,decode}.* (BENCH_PREFILL=1, BENCH_DECODE=1); where nvidia-smi
#                       runs, gpu-clocks-<start>.csv: the GPU's clocks, power, utilization and clock-event reasons
#                       and the host's load every 5 s of each call
#                       (lab/gpu/gpu_clocks.py); triton-kernels.txt: each Triton kernel compiled
#                       on the machine, its variants and cubin bytes (TRITON_CACHE_DIR, in $RUN_DIR);
#                       jit-modules.txt: the modules nvcc built (TVM_FFI_CACHE_DIR, in $RUN_DIR), bytes, time
#   accuracy_vs_length.png
#   report.md           written last
# To continue on a fresh machine, put the returned state.tgz in a folder that travels with the checkout
# (e.g. .acc-state/, listed in .git/info/exclude and named in the call's carry) and set RESUME to it.
# A fresh machine's first server start builds what a held one has cached (150 s against 34 s on an H200; 81 s
# with the Triton and nvcc caches carried): CACHE_OUT=1 adds compile-cache.tar.xz to $OUT (the Triton kernels,
# nvcc-built modules and Inductor graphs this machine built, and its CUDA driver and NVRTC caches,
# lab/gpu/compile_cache.py; CACHE_S more seconds are reserved for packing it), and CACHE_IN=<dir holding it>
# unpacks it into the empty caches of the next fresh machine. Weights may travel xz-compressed (a bf16 shard
# <name>.safetensors.xz in MODEL, 71% of its size for configs/msa-medium): they are decompressed beside it
# unless <name>.safetensors is there.
#
# Env: BUDGET_S (540), AGREE_S (150), RESERVE_S (30: report and packing, and the grace of a round that runs
# long), MIN_STEP_S (60: the least time a step, the served comparison or one agreement format, is started
# with; the tests lower it), FORMATS ("fp8 mxfp4 mxfp4_rot bf16 dense"; a replica such as fp8@2 serves fp8 again as an arm of its
# own), MAX_FORMATS (1), LARGE_FORMATS
# ("fp8 mxfp4"), N_LARGE (1000), N_SMALL (100), TASKS ("m3_niah_single
# m3_niah_multikey m3_kv_64 m3_vt_value": kv at 64 pairs and vt asking a value, the variants the medium model
# can fail or pass at every length, docs/accuracy.md section 5; m3_kv and m3_vt are the drawn ones),
# LENGTHS ("8192 32768 65536 131072"), CHUNK (4), QUESTIONS (1: questions per context where a task takes several,
# multi-key up to 4, m3_kv_64 up to 16; a multiple of it as CHUNK keeps a context's questions in one round so the
# radix cache prefills it once), CONCURRENCY (8), AGREE_FORMATS ("bf16 fp8 mxfp4
# mxfp4_rot"), AGREE_SAMPLES (4), AGREE_LENGTHS (LENGTHS), LAUNCH_ARGS (replaces the server arguments below),
# RUN_DIR, OUT, RESUME, FRESH=1 (drop $RUN_DIR's state first), CACHE_IN, CACHE_OUT, CACHE_S (30), PYTHON (python3),
# BENCH_PREFILL=1 / BENCH_DECODE=1 (time SGLang's sparse prefill / decode attention under each autotune candidate
# first, BENCH_DECODE after the kernels' GPU tests; the tables in call.log, their files in logs.tgz),
# GRAPH_CHECK=1 (first, CUDA-graph replay against eager decode on MODEL, MXFP4, 8 needle prompts at 8k and 32k:
# lab/gpu/graph_vs_eager.py with the kernels held as the comparison holds them; its table in call.log),
# M3_SPARSE_PREFILL_CONFIG / M3_SPARSE_DECODE_CONFIG
# (WARPS,STAGES: every server holds that candidate; on a GPU 4,3 and 4,4 unless set, empty: each server autotunes),
# WRITTEN_ROOTS (the folders searched for what the call wrote outside its own, each PATH or NAME=PATH, printed as
# $NAME/...; on a GPU by default $HOME, /tmp, the checkout and the interpreter's prefix, named; on the CPU none),
# DEVICE (cuda; cpu: no bundle, the CPU server arguments, for the smoke test lab/tests/scripts/test_accuracy_h200.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( BUDGET_S - $(elapsed) - RESERVE_S )); }

MODEL="${1:-configs/msa-medium}"
OUT="${OUT:-out/accuracy-h200}"
RUN_DIR="${RUN_DIR:-build/accuracy-h200}"
BUDGET_S="${BUDGET_S:-540}"
AGREE_S="${AGREE_S:-150}"
RESERVE_S="${RESERVE_S:-30}"
MIN_STEP_S="${MIN_STEP_S:-60}"
CACHE_S="${CACHE_S:-30}"
[ -n "${CACHE_OUT:-}" ] && RESERVE_S=$(( RESERVE_S + CACHE_S ))
FORMATS="${FORMATS:-fp8 mxfp4 mxfp4_rot bf16 dense}"
MAX_FORMATS="${MAX_FORMATS:-1}"
LARGE_FORMATS="${LARGE_FORMATS:-fp8 mxfp4}"
N_LARGE="${N_LARGE:-1000}"
N_SMALL="${N_SMALL:-100}"
TASKS="${TASKS:-m3_niah_single m3_niah_multikey m3_kv_64 m3_vt_value}"
LENGTHS="${LENGTHS:-8192 32768 65536 131072}"
CHUNK="${CHUNK:-4}"
QUESTIONS="${QUESTIONS:-1}"
CONCURRENCY="${CONCURRENCY:-8}"
AGREE_FORMATS="${AGREE_FORMATS-bf16 fp8 mxfp4 mxfp4_rot}"  # set empty: no agreement
AGREE_SAMPLES="${AGREE_SAMPLES:-4}"
AGREE_LENGTHS="${AGREE_LENGTHS:-$LENGTHS}"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT" "$RUN_DIR"
touch "$RUN_DIR/.call-start"  # what this call writes outside its folders is listed against it at the end
exec > >(tee -a "$OUT/call.log") 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Triton's autotuner prints its pick into the server logs (not part of any cache key): SGLang's sparse prefill
# attention picks one of 9 configurations at its first call in each server, and a server's prefill rate varied by
# up to a fifth from one start to the next at the same clocks (lab/gpu/call_timings.py puts them side by side)
export TRITON_PRINT_AUTOTUNING=1
echo "accuracy_h200: start $(date -u +%FT%TZ), model $MODEL, budget ${BUDGET_S}s, device $DEVICE," \
     "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

if [ ! -f "$MODEL/config.json" ]; then
    echo "error: $MODEL has no config.json; pass an exported checkpoint folder (the medium model: tar -xzf" \
         "export.tgz && mv export configs/msa-medium, docs/accuracy.md section 5)"
    exit 2
fi
case " $FORMATS " in
    *" fp8 "*) ;;
    *) echo "error: FORMATS=\"$FORMATS\" must include fp8, the baseline every format is paired with (to serve only" \
            "mxfp4: FORMATS=\"fp8 mxfp4\"; the format furthest from its target is served)"
       exit 2 ;;
esac
for z in "$MODEL"/*.safetensors.xz; do
    [ -f "$z" ] || continue
    python3 lab/gpu/compile_cache.py unxz "$z" || { echo "error: could not decompress $z"; exit 2; }
done
max_len=0
for n in $LENGTHS $AGREE_LENGTHS; do [ "$n" -gt "$max_len" ] && max_len=$n; done
context=$(( max_len + 256 ))
# Triton's kernel cache in the run directory, so the call can list what its servers compiled (a sparse-format
# server's CUDA-graph capture took 77-84 s on a fresh H200, a server with every layer dense 2.4 s), and pack it
run_dir_abs=$(cd "$RUN_DIR" && pwd)
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$run_dir_abs/triton-cache}"
# and the nvcc-built (TVM-FFI) modules' cache, listed the same way (jit-modules.txt)
export TVM_FFI_CACHE_DIR="${TVM_FFI_CACHE_DIR:-$run_dir_abs/jit-cache}"
# and torch Inductor's (SGLang's torch.compile activations, compiled at the first capture: a fresh machine with the
# other two caches carried spent 38 s in its first captured batch, a held one 2 s)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$run_dir_abs/inductor-cache}"
# and two caches a fresh machine may rebuild in that capture while a held one keeps them: the CUDA driver's (PTX
# compiled for this GPU) and torch's NVRTC kernels (lab/gpu/files_written.py shows what else is written)
export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$run_dir_abs/cuda-cache}"
export PYTORCH_KERNEL_CACHE_PATH="${PYTORCH_KERNEL_CACHE_PATH:-$run_dir_abs/torch-kernels}"
extra_caches=(--extra "cuda=$CUDA_CACHE_PATH" --extra "torch-kernels=$PYTORCH_KERNEL_CACHE_PATH")
if [ -n "${CACHE_IN:-}" ]; then
    if [ -f "$CACHE_IN/compile-cache.tar.xz" ]; then
        python3 lab/gpu/compile_cache.py unpack "$CACHE_IN/compile-cache.tar.xz" "$TRITON_CACHE_DIR" \
            "$TVM_FFI_CACHE_DIR" --inductor-dir "$TORCHINDUCTOR_CACHE_DIR" "${extra_caches[@]}" \
            || echo "compile caches not unpacked: building them as a fresh machine does"
    else
        echo "CACHE_IN=$CACHE_IN holds no compile-cache.tar.xz: building the caches as a fresh machine does"
    fi
fi
if [ "$DEVICE" = cpu ]; then
    export PYTHONPATH="$PWD:$PWD/kernels:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
    default_launch="--device cpu --attention-backend torch_native --max-total-tokens $(( 2 * context ))
                    --context-length $context --skip-server-warmup"
else
    source lab/gpu/bundle_env.sh || exit 1
    PYTHON=python3
    # CUDA graphs on for decode (the plugin keeps prefill eager); batch sizes up to the concurrency (each
    # captured size costs start-up: 36-98 s for 1, 2, 4, 8 on an H200, lab/logs/accuracy-h200-log.md).
    default_launch="--attention-backend triton --sampling-backend pytorch --grammar-backend none
                    --disable-piecewise-cuda-graph --cuda-graph-max-bs $CONCURRENCY
                    --context-length $context --mem-fraction-static 0.85 --random-seed 0"
fi
# shellcheck disable=SC2206
LAUNCH=(${LAUNCH_ARGS:-$default_launch})
if ! "$PYTHON" -c "import lm_eval, datasets, transformers, scipy, matplotlib" 2>/dev/null; then
    echo "error: $PYTHON lacks lm-eval or its dependencies (the H200 bundle carries them:" \
         "lab/gpu/build_wheel_bundle.sh)"
    "$PYTHON" -c "import lm_eval, datasets, transformers, scipy, matplotlib"
    exit 1
fi

# SGLang's sparse attention kernels: autotuned by each server (prefill at its first call, a 128-token warm-up; decode
# at each batch bucket while it captures its CUDA graphs), or held to one candidate by M3_SPARSE_PREFILL_CONFIG and
# M3_SPARSE_DECODE_CONFIG=WARPS,STAGES (sglang_m3/sparse_attention.py); once held, hold them for the rest of the run,
# since a call serves one format. BENCH_PREFILL=1 / BENCH_DECODE=1 first time every candidate at the model's shapes.
if [ -n "${BENCH_PREFILL:-}" ] && [ "$DEVICE" != cpu ]; then
    echo "[$(elapsed)s] SGLang's sparse prefill attention under each candidate (lab/gpu/bench_sparse_prefill.py):"
    timeout 180 "$PYTHON" lab/gpu/bench_sparse_prefill.py --out "$RUN_DIR/bench" \
        || echo "bench_sparse_prefill failed"
fi
if [ -n "${BENCH_DECODE:-}" ] && [ "$DEVICE" != cpu ]; then
    # correctness first: every candidate of both kernels against the float64 oracle (lengths 1, 127, 128, 129, ...)
    mkdir -p "$RUN_DIR/bench"
    echo "[$(elapsed)s] the sparse attention kernels' GPU tests:"
    timeout 180 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -s tests/sglang_m3/test_sparse_attention.py \
        lab/tests/scripts/test_bench_sparse_decode.py > "$RUN_DIR/bench/pytest_gpu.log" 2>&1 \
        || echo "the GPU tests failed (logs.tgz: bench-pytest_gpu.log)"
    grep -E "candidates against the first|passed|failed|Error" "$RUN_DIR/bench/pytest_gpu.log" | tail -12
    echo "[$(elapsed)s] SGLang's sparse decode attention under each candidate (lab/gpu/bench_sparse_decode.py):"
    timeout 240 "$PYTHON" lab/gpu/bench_sparse_decode.py --out "$RUN_DIR/bench" \
        || echo "bench_sparse_decode failed"
fi
# The comparison's own settings from call 35 on (docs/perf.md: the fastest candidates on an H100; those of 4 warps
# round alike): held unless set, and an empty value lets each server autotune again
if [ "$DEVICE" != cpu ]; then
    export M3_SPARSE_PREFILL_CONFIG="${M3_SPARSE_PREFILL_CONFIG-4,3}" M3_SPARSE_DECODE_CONFIG="${M3_SPARSE_DECODE_CONFIG-4,4}"
fi
for kernel in prefill decode; do
    var="M3_SPARSE_${kernel^^}_CONFIG"
    if [ -n "${!var:-}" ]; then
        echo "sparse $kernel attention: held to $var=${!var} in every server"
    else
        echo "sparse $kernel attention: autotuned by each server"
    fi
done
if [ -n "${GRAPH_CHECK:-}" ] && [ "$DEVICE" != cpu ]; then
    # The decode path the comparison serves, replayed from CUDA graphs, against an eager server of the same model:
    # greedy tokens equal, prompt by prompt (a check of the plugin's graph buffers before a call's rows are trusted).
    mkdir -p "$RUN_DIR/gve"
    echo "[$(elapsed)s] CUDA-graph replay against eager decode (lab/gpu/graph_vs_eager.py, mxfp4):"
    timeout --kill-after=30 300 "$PYTHON" lab/gpu/graph_vs_eager.py --model "$MODEL" --formats mxfp4 \
        --lengths 8192,32768 --samples 4 --out "$RUN_DIR/gve" > "$RUN_DIR/gve/run.out" 2>&1 \
        || echo "graph_vs_eager failed (logs.tgz: gve-run.out)"
    [ -f "$RUN_DIR/gve/table.md" ] && tail -n 4 "$RUN_DIR/gve/table.md"
fi

# The GPU's clocks, power, utilization and clock-event reasons and the host's load every 5 s through the call
# (logs.tgz: gpu-clocks-*.csv), summed up in a line at the end: a slow call's prefill rate (67k against 84k tokens/s
# on one machine, lab/logs/accuracy-h200-log.md) is then read as a lower clock, a busy host, or neither
sampler=""
served_on=()
if command -v nvidia-smi > /dev/null; then
    # Which card ran this call (an H200 or, where one serves for it, an H100): the answers are compared per
    # prompt across calls, so the log names the card, and every sample row it adds does (served_on), from which
    # the report counts the pairs whose two answers came from different cards
    gpu=$(nvidia-smi -i 0 --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null)
    echo "gpu: $gpu"
    served_on=(--served-on "${gpu%%,*}")
    mkdir -p "$RUN_DIR/gpu-clocks"
    clocks_csv="$RUN_DIR/gpu-clocks/$(date -u +%Y%m%dT%H%M%SZ).csv"
    python3 lab/gpu/gpu_clocks.py sample "$clocks_csv" --every 5 &
    sampler=$!
    trap '[ -n "$sampler" ] && kill "$sampler" 2> /dev/null' EXIT
fi

# --- state ---------------------------------------------------------------------------------------------
if [ -n "${FRESH:-}" ]; then
    rm -rf "$RUN_DIR/acc" "$RUN_DIR/agreement"
fi
if [ -n "${RESUME:-}" ]; then
    if [ -d "$RUN_DIR/acc/samples" ]; then
        echo "RESUME=$RESUME ignored: $RUN_DIR already holds this machine's state (at least as new)"
    elif [ -f "$RESUME/state.tgz" ] || ls "$RESUME"/state.tgz.part-* > /dev/null 2>&1; then
        if [ -f "$RESUME/state.tgz" ]; then
            tar -C "$RUN_DIR" -xzf "$RESUME/state.tgz" || exit 1
        else
            cat "$RESUME"/state.tgz.part-* | tar -C "$RUN_DIR" -xzf - || exit 1
        fi
        echo "resumed from $RESUME: $(find "$RUN_DIR/acc/samples" -name '*.jsonl' -exec cat {} + 2>/dev/null \
              | wc -l) sample rows"
    else
        echo "error: RESUME=$RESUME holds no state.tgz"
        exit 2
    fi
fi
mkdir -p "$RUN_DIR/acc" "$RUN_DIR/agreement"
pack_state() {  # $OUT/state.tgz (or its 15 MiB parts): replaced whole, never left half written
    local tmp="$RUN_DIR/state.tgz.tmp"
    tar -C "$RUN_DIR" -czf "$tmp" acc/samples $( [ -f "$RUN_DIR/acc/rates.json" ] && echo acc/rates.json ) \
        $( [ -d "$RUN_DIR/agreement/formats" ] && echo agreement/formats ) || { echo "state not packed"; return 1; }
    rm -f "$OUT"/state.tgz.part-*
    if [ "$(stat -c %s "$tmp")" -gt $(( 15 * 1048576 )) ]; then
        rm -f "$OUT/state.tgz" && split -b 15m "$tmp" "$OUT/state.tgz.part-" && rm "$tmp"
    else
        mv "$tmp" "$OUT/state.tgz"
    fi
}
agreement_done() {
    for f in $AGREE_FORMATS; do [ -f "$RUN_DIR/agreement/formats/$f.json" ] || return 1; done
}

# --- 1. the format comparison ----------------------------------------------------------------------------
format_samples=()
for f in $FORMATS; do
    n=$N_SMALL
    for g in $LARGE_FORMATS; do [ "$f" = "$g" ] && n=$N_LARGE; done
    format_samples+=("$f=$n")
done
# shellcheck disable=SC2086
ACC=("$PYTHON" -m accuracy.run --model "$MODEL" --formats $FORMATS --baseline fp8 --tasks $TASKS
     --lengths $LENGTHS --samples "$N_SMALL" --format-samples "${format_samples[@]}" --chunk "$CHUNK"
     --questions "$QUESTIONS"
     --concurrency "$CONCURRENCY" --max-formats "$MAX_FORMATS" --resume --out "$RUN_DIR/acc" "${served_on[@]}")
acc_s=$(( $(left) - $(agreement_done && echo 0 || echo "$AGREE_S") ))
acc_rc=0
if [ "$acc_s" -ge "$MIN_STEP_S" ]; then
    echo "[$(elapsed)s] m3-accuracy: ${acc_s}s"
    # The runner ends its last round by its budget; a round that runs long is stopped when the reserve (at most
    # 60 s) is spent too, so it ends by BUDGET_S + 30 s: a call made with BUDGET_S=570 keeps its state under the
    # machine's 600 s limit (SIGTERM drops only the round under way: rows are appended as each piece ends)
    timeout --signal=TERM --kill-after=30 "$(( acc_s + (RESERVE_S < 60 ? RESERVE_S : 60) ))" \
        "${ACC[@]}" --budget-s "$acc_s" -- "${LAUNCH[@]}"
    acc_rc=$?
    echo "[$(elapsed)s] m3-accuracy exit $acc_rc"
    pack_state  # now, and again at the end: a call cut off after this point still returns its rows
else
    echo "[$(elapsed)s] m3-accuracy: only ${acc_s}s left, not served this call"
fi

# --- 2. selection agreement ------------------------------------------------------------------------------
# shellcheck disable=SC2086
AGR=("$PYTHON" -m accuracy.agreement --model "$MODEL" --lengths $AGREE_LENGTHS --samples "$AGREE_SAMPLES"
     --depths "$AGREE_SAMPLES" --out "$RUN_DIR/agreement" --reuse)
for f in $AGREE_FORMATS; do
    [ -f "$RUN_DIR/agreement/formats/$f.json" ] && continue
    s=$(left)
    if [ "$s" -lt "$MIN_STEP_S" ]; then
        echo "[$(elapsed)s] agreement: ${s}s left, $f and later formats next call"
        break
    fi
    echo "[$(elapsed)s] agreement: serving $f (at most ${s}s)"
    timeout --signal=TERM --kill-after=90 "$s" "${AGR[@]}" --formats "$f" -- "${LAUNCH[@]}" > "$RUN_DIR/agreement/$f.out" 2>&1
    echo "[$(elapsed)s] agreement $f exit $? (tail of its output:)"
    tail -n 5 "$RUN_DIR/agreement/$f.out"
done
saved=()
for f in $AGREE_FORMATS; do [ -f "$RUN_DIR/agreement/formats/$f.json" ] && saved+=("$f"); done
rm -f "$RUN_DIR/agreement/agreement.md"
if [ "${#saved[@]}" -ge 2 ]; then
    "${AGR[@]}" --formats "${saved[@]}" -- "${LAUNCH[@]}" > "$RUN_DIR/agreement/tables.out" 2>&1 \
        || { echo "agreement tables failed:"; tail -n 20 "$RUN_DIR/agreement/tables.out"; }
fi

# --- 3. report and files ---------------------------------------------------------------------------------
if [ "$acc_rc" -ne 0 ] || [ ! -f "$RUN_DIR/acc/report.md" ]; then
    echo "[$(elapsed)s] report from the saved rows (serves nothing)"
    "${ACC[@]}" --budget-s 0 -- "${LAUNCH[@]}" > "$RUN_DIR/acc/report.out" 2>&1 \
        || { echo "report failed:"; tail -n 20 "$RUN_DIR/acc/report.out"; }
fi
pack_state
if [ -n "$sampler" ]; then
    kill "$sampler" 2> /dev/null
    wait "$sampler" 2> /dev/null
    sampler=""
    [ -f "$clocks_csv" ] && python3 lab/gpu/gpu_clocks.py summarize "$clocks_csv"
fi
logs=$(mktemp -d)
mkdir -p "$logs/logs"
for f in "$RUN_DIR"/acc/server-*.log "$RUN_DIR"/agreement/server-*.log "$RUN_DIR"/agreement/*.out \
         "$RUN_DIR"/gpu-clocks/*.csv "$RUN_DIR"/bench/bench_sparse_*.* "$RUN_DIR"/bench/pytest_gpu.log \
         "$RUN_DIR"/gve/*.log "$RUN_DIR"/gve/run.out "$RUN_DIR"/gve/table.md; do
    [ -f "$f" ] && tail -c 2097152 "$f" > "$logs/logs/$(basename "$(dirname "$f")")-$(basename "$f")"
done
if [ -d "${TRITON_CACHE_DIR:-}" ]; then  # kernel name, compiled variants, cubin bytes
    find "$TRITON_CACHE_DIR" -name '*.cubin' -printf '%f %s\n' | awk '{sub(/\.cubin$/, "", $1); n[$1]++; b[$1] += $2}
        END {for (k in n) print k, n[k], b[k]}' | sort > "$logs/logs/triton-kernels.txt"
    echo "Triton kernels in this machine's cache (built here or unpacked from CACHE_IN):" \
         "$(wc -l < "$logs/logs/triton-kernels.txt") kernels," \
         "$(awk '{s += $2} END {print s + 0}' "$logs/logs/triton-kernels.txt") variants (logs.tgz: triton-kernels.txt)"
fi
if [ -d "${TVM_FFI_CACHE_DIR:-}" ]; then  # module file, bytes, build time (UTC)
    find "$TVM_FFI_CACHE_DIR" -name '*.so' -printf '%P %s %TFT%TT\n' | sort -k3 > "$logs/logs/jit-modules.txt"
    echo "nvcc-built modules in this machine's cache: $(wc -l < "$logs/logs/jit-modules.txt") (logs.tgz: jit-modules.txt)"
fi
# what this machine compiled itself: files unpacked from CACHE_IN carry the time 1970-01-01
for d in TRITON_CACHE_DIR TVM_FFI_CACHE_DIR TORCHINDUCTOR_CACHE_DIR CUDA_CACHE_PATH PYTORCH_KERNEL_CACHE_PATH; do
    if [ -d "${!d}" ]; then
        local_files=$(find "${!d}" -type f -newermt 1971-01-01 | wc -l)
        echo "$d: $(find "${!d}" -type f | wc -l) files, $local_files written here"
    fi
done
if [ "$DEVICE" != cpu ]; then
    prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
    WRITTEN_ROOTS="${WRITTEN_ROOTS:-HOME=${HOME:-$PWD} TMPDIR=${TMPDIR:-/tmp} CHECKOUT=$PWD PREFIX=$prefix}"
fi
if [ -n "${WRITTEN_ROOTS:-}" ]; then
    # shellcheck disable=SC2086
    python3 lab/gpu/files_written.py "$RUN_DIR/.call-start" $WRITTEN_ROOTS --skip "$RUN_DIR" --skip "$OUT" \
        --skip "$logs" --out "$logs/logs/files-written.txt"
fi
tar -C "$logs" -czf "$OUT/logs.tgz" logs && rm -rf "$logs"
if [ -n "${CACHE_OUT:-}" ]; then
    # the CUDA driver's cache or Inductor's can outgrow a returned file (a CPU server's C++ builds): then they stay
    pack=(python3 lab/gpu/compile_cache.py pack "$TRITON_CACHE_DIR" "$TVM_FFI_CACHE_DIR"
          "$OUT/compile-cache.tar.xz")
    "${pack[@]}" --inductor-dir "$TORCHINDUCTOR_CACHE_DIR" "${extra_caches[@]}" \
        || "${pack[@]}" --inductor-dir "$TORCHINDUCTOR_CACHE_DIR" || "${pack[@]}" || echo "compile caches not packed"
fi
[ -f "$RUN_DIR/acc/results.json" ] && cp "$RUN_DIR/acc/results.json" "$OUT/results.json"
[ -f "$RUN_DIR/acc/accuracy_vs_length.png" ] && cp "$RUN_DIR/acc/accuracy_vs_length.png" "$OUT/"
[ -f "$RUN_DIR/agreement/agreement.md" ] && cp "$RUN_DIR/agreement/agreement.json" "$OUT/agreement.json"
{
    echo "# Index-K format comparison: $MODEL"
    echo
    echo "lab/gpu/accuracy_h200.sh, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
         "device $DEVICE, this call $(elapsed) s of BUDGET_S=$BUDGET_S. Formats $FORMATS (baseline fp8);" \
         "samples per task and length: $LARGE_FORMATS $N_LARGE, others $N_SMALL; tasks $TASKS; lengths $LENGTHS."
    echo
    if [ -f "$RUN_DIR/acc/report.md" ]; then cat "$RUN_DIR/acc/report.md"; else echo "(no accuracy report)"; fi
    echo
    if [ -n "$AGREE_FORMATS" ]; then
        echo "## Selection agreement (accuracy.agreement; formats done: ${saved[*]:-none} of $AGREE_FORMATS)"
        echo
        if [ -f "$RUN_DIR/agreement/agreement.md" ]; then cat "$RUN_DIR/agreement/agreement.md"
        else echo "(not yet: needs bf16 and one more format)"; fi
    fi
} > "$RUN_DIR/report.md"
cp "$RUN_DIR/report.md" "$OUT/report.md"
n=$(find "$OUT" -type f | wc -l)
big=$(find "$OUT" -type f -size +15M | wc -l)
echo "[$(elapsed)s] accuracy_h200: $n files in \$OUT (at most 8 come back), $big over 15 MiB"
ls -l "$OUT"
touch "$OUT/report.md"
exit "$acc_rc"
