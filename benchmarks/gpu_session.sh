#!/usr/bin/env bash
# Everything issue 43 asks of a GPU, as one prepared call for a lent machine (the device tool's `run`: an H200
# whose image has torch 2.11, triton 3.6, transformers 5.17, hypothesis and pytest, but not kvcompile, and no
# network). It runs from the copy of the repository tree the tool sends; nothing is installed.
#
#   bash benchmarks/gpu_session.sh             # ~8 minutes: run with timeout_s=600
#   bash benchmarks/gpu_session.sh --quick     # < 3 minutes: 3 layouts' correctness, decode at batch 8 x 32K
#   bash benchmarks/gpu_session.sh --quick --tile int4=256,4,3 int2=256,8,3   # a tuning round
#   bash benchmarks/gpu_session.sh --autotune  # ~5 minutes: time the decode tiles, write the config table
#   KVCOMPILE_PTX_UNPACK=0 bash benchmarks/gpu_session.sh --quick   # int4 / int2 codes unpacked in Triton's
#                                              # integer ops, not inline PTX (templates/decode.py): to tell them apart
#
# Steps, most important first, each cut off so the whole call ends before BUDGET_S seconds (default 470, quick
# 170, autotune 300):
#   1. kernels   python benchmarks/gpu_kernels.py   correctness of every layout (store bit-exact, attention in
#                its bound), then decode against bf16 SDPA, the targets, prefill, the store kernel
#   2. tests     pytest on CUDA: the Triton tests of tests/templates (what runs there, not the CPU's C kernels)
#   3. autotune  python benchmarks/gpu_autotune.py  with what is left (at least 60 s), or alone (--autotune)
# Outputs land in $OUT (the tool brings back at most 8 files): session.log, kernels.md and kernels.json,
# tests.txt, autotune.txt and decode_configs.json (the timed table: copy it to templates/ when it is better).
#
# KVC_SESSION_SMOKE=1 runs the same plumbing at tiny sizes on a machine without a GPU (the tests do).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=$(realpath -m "${OUT:-$(mktemp -d)}")
mkdir -p "$OUT"
MODE=full
TILES=()
while [ $# -gt 0 ]; do
    case $1 in
        --quick) MODE=quick ;;
        --autotune) MODE=autotune ;;
        --tile) shift; while [ $# -gt 0 ] && [[ $1 != --* ]]; do TILES+=("$1"); shift; done; continue ;;
        *) echo "unknown argument $1 (expected --quick, --autotune, --tile FORMAT=BLOCK_N,WARPS,STAGES ...)"; exit 2 ;;
    esac
    shift
done
case $MODE in full) DEFAULT=470 ;; quick) DEFAULT=170 ;; autotune) DEFAULT=300 ;; esac
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-$DEFAULT}))
SMOKE=${KVC_SESSION_SMOKE:-0}
log() { echo "[$(date +%T) +$(($(date +%s) - START))s] $*" | tee -a "$OUT/session.log"; }
left() { echo $((DEADLINE - $(date +%s))); }

# kvcompile without pip: a folder laid out as the installed package (passes/ and templates/ install as
# kvcompile.passes and kvcompile.templates), first on the path and the working directory of every step.
SITE=$(mktemp -d)
mkdir -p "$SITE/kvcompile"
for f in "$ROOT"/kvcompile/*; do ln -s "$f" "$SITE/kvcompile/"; done
ln -s "$ROOT/passes" "$SITE/kvcompile/passes"
ln -s "$ROOT/templates" "$SITE/kvcompile/templates"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$SITE" || exit 1
python - <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import importlib.util, torch, triton, kvcompile, kvcompile.templates
print("kvcompile from", kvcompile.__file__, kvcompile.templates.__file__)
print(f"torch {torch.__version__}, triton {triton.__version__}")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA",
      torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else "", "SMs")
for m in ("hypothesis", "pytest_timeout", "transformers"):
    print(m, "importable" if importlib.util.find_spec(m) else "MISSING")
EOF
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$OUT/session.log" 2>&1

step() {  # step NAME SECONDS COMMAND...: run with at most SECONDS (and never past the deadline)
    local name=$1 want=$2
    shift 2
    local t
    t=$(left)
    if [ "$t" -lt 30 ]; then log "skip $name: $t s left"; return 1; fi
    [ "$want" -lt "$t" ] && t=$want
    log "start $name (at most $t s): $*"
    timeout --signal=INT --kill-after=10 "$t" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    log "end $name: exit $rc$( { [ $rc = 124 ] || [ $rc = 137 ]; } && echo ' (cut off)')"
    tail -n 60 "$OUT/$name.txt"
    return $rc
}

TESTS="test_decode_kernel.py test_pages_triton.py test_attention_kernel.py test_prefill_sdpa.py test_store_kernel.py test_rotate.py
       test_ops_triton.py test_triton_prerope.py test_kernel_devices.py test_device_messages.py"
TEST_PATHS=()
for t in $TESTS; do TEST_PATHS+=("$ROOT/tests/templates/$t"); done
TIMEOUT_ARG=()
python -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARG=(--timeout 240)
PYTEST=(python -m pytest -q -p no:cacheprovider -c "$ROOT/pyproject.toml" --rootdir "$ROOT" "${TIMEOUT_ARG[@]}")
TILE_ARGS=()
[ ${#TILES[@]} -gt 0 ] && TILE_ARGS=(--tile "${TILES[@]}")

if [ "$SMOKE" = 1 ]; then
    step kernels 240 python "$ROOT/benchmarks/gpu_kernels.py" --smoke --out "$OUT/kernels.md"
    step tests 120 "${PYTEST[@]}" "$ROOT/tests/templates/test_device_messages.py"
    step autotune 60 python "$ROOT/benchmarks/gpu_autotune.py" --smoke
elif [ "$MODE" = autotune ]; then
    step autotune $(( $(left) - 15 )) python "$ROOT/benchmarks/gpu_autotune.py" --budget $(( $(left) - 60 )) \
        --out "$OUT/decode_configs.json"
elif [ "$MODE" = quick ]; then
    step kernels 150 python "$ROOT/benchmarks/gpu_kernels.py" --quick --out "$OUT/kernels.md" "${TILE_ARGS[@]}"
else
    step kernels 300 python "$ROOT/benchmarks/gpu_kernels.py" --out "$OUT/kernels.md" "${TILE_ARGS[@]}"
    # the tests on CUDA: the decode kernel's first; -x would hide the rest, so every failure is listed
    step tests 150 "${PYTEST[@]}" --maxfail 10 "${TEST_PATHS[@]}"
    if [ "$(left)" -ge 90 ]; then
        step autotune $(( $(left) - 20 )) python "$ROOT/benchmarks/gpu_autotune.py" --budget $(( $(left) - 50 )) \
            --out "$OUT/decode_configs.json"
    else
        log "skip autotune: $(left) s left (run bash benchmarks/gpu_session.sh --autotune)"
    fi
fi
log "done; $(left) s of the budget left"
