#!/usr/bin/env bash
# Everything issues 3 and 6 ask of a GPU, as one prepared call for a lent machine (the device tool's `run`,
# whose image has torch, triton and transformers but not kvcompile, and no network). Steps, most important
# first, each cut off so the whole call ends before BUDGET_S seconds (default 540: a `run` may last 600):
#
#   1. kernels  python benchmarks/gpu_kernels.py --record       correctness on the device, then the timing table
#   2. e2e      python benchmarks/cpu_decode.py --device cuda ...   end to end: bf16 StaticCache + compile,
#               QuantizedCache quanto int4 (when optimum-quanto is importable) and kvcompile int4, 1B random Llama
#   3. tests    python -m pytest -q tests/templates              the kernel tests, compiled for the GPU
#   4. tp       python benchmarks/tp_bytes.py --device cuda      tensor parallelism over NCCL (2+ GPUs only)
#
# Outputs land in $OUT (the device tool brings them back): session.log, one <step>.txt per step, and
# results.md, docs/results.md with the steps' entries on top (copy them into docs/results.md here).
#
# Before the call, on the development machine (the device cannot reach a package index):
#     pip download --no-deps -d wheelhouse hypothesis attrs sortedcontainers exceptiongroup optimum-quanto ninja psutil
#     for v in 3.10 3.12 3.13; do pip download --no-deps -d wheelhouse --python-version $v --only-binary=:all: \
#         --platform manylinux2014_x86_64 hypothesis; done      # hypothesis wheels are per Python version
# and pass carry=["wheelhouse"] to `run`:   command: bash benchmarks/gpu_session.sh
#
# KVC_SESSION_SMOKE=1 runs the same plumbing at tiny sizes on a machine without a GPU (the tests do).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$(realpath -m "${OUT:-$(mktemp -d)}")
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-540}))
SMOKE=${KVC_SESSION_SMOKE:-0}
log() { echo "[$(date +%T) +$(($(date +%s) - START))s] $*" | tee -a "$OUT/session.log"; }
left() { echo $((DEADLINE - $(date +%s))); }

# kvcompile without pip: a directory laid out as the installed package (passes/ and templates/ install as
# kvcompile.passes and kvcompile.templates), first on the path and the working directory of every step (a
# checkout's own kvcompile/ lacks those two, and `python -m` puts the working directory first).
SITE=$(mktemp -d)
mkdir -p "$SITE/kvcompile"
for f in "$ROOT"/kvcompile/*; do ln -s "$f" "$SITE/kvcompile/"; done
ln -s "$ROOT/passes" "$SITE/kvcompile/passes"
ln -s "$ROOT/templates" "$SITE/kvcompile/templates"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$ROOT/wheelhouse" ]; then
    python -m pip install -q --no-index --find-links "$ROOT/wheelhouse" hypothesis optimum-quanto >>"$OUT/session.log" 2>&1 \
        || log "wheelhouse install failed (see above); steps that need it will say so"
fi
cd "$SITE"
python - <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import importlib.util, torch, triton, transformers, kvcompile, kvcompile.passes, kvcompile.templates
print("kvcompile from", kvcompile.__file__, kvcompile.passes.__file__, kvcompile.templates.__file__)
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
for m in ("hypothesis", "optimum.quanto"):
    try:
        print(m, "importable" if importlib.util.find_spec(m) else "MISSING")
    except ModuleNotFoundError:
        print(m, "MISSING")
EOF
cp "$ROOT/docs/results.md" "$OUT/results.md.before"

step() {  # step NAME SECONDS COMMAND...: run with at most SECONDS (and never past the deadline)
    local name=$1 want=$2
    shift 2
    local t
    t=$(left)
    if [ "$t" -lt 30 ]; then log "skip $name: $t s left"; return; fi
    [ "$want" -lt "$t" ] && t=$want
    log "start $name (at most $t s): $*"
    timeout --signal=INT --kill-after=10 "$t" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    log "end $name: exit $rc$([ $rc = 124 ] && echo ' (cut off)')"
    tail -n 40 "$OUT/$name.txt"
    cp "$ROOT/docs/results.md" "$OUT/results.md"
}

quanto=$(python -c "import importlib.util as u; print(bool(u.find_spec('optimum') and u.find_spec('optimum.quanto')))" 2>/dev/null)
contenders="static+compile kvc-int4"
[ "$quanto" = "True" ] && contenders="static+compile quanto-int4 kvc-int4"
if [ "$SMOKE" = 1 ]; then
    step kernels 120 python $ROOT/benchmarks/gpu_kernels.py --smoke
    step e2e 120 python $ROOT/benchmarks/cpu_decode.py --smoke --out "$OUT/e2e.json"
    step tests 120 python -m pytest -q -p no:cacheprovider -c "$ROOT/pyproject.toml" --rootdir "$ROOT" \
        "$ROOT/tests/templates/test_ops_triton.py" -k too_old
else
    step kernels 330 python $ROOT/benchmarks/gpu_kernels.py --record
    step e2e 240 python $ROOT/benchmarks/cpu_decode.py --device cuda --random-llama 1b --dtype bfloat16 \
        --batches 8 32 --contexts 8192 32768 --new 32 --repeats 2 --prefill-chunk 4096 \
        --contenders $contenders --record --out "$OUT/e2e.json"
    step tests 200 python -m pytest -q -x -p no:cacheprovider -c "$ROOT/pyproject.toml" --rootdir "$ROOT" \
        "$ROOT/tests/templates"
    # tensor parallelism over NCCL (per-rank cache bytes, kvcompile.apply on a tp_plan="auto" model): one GPU per rank
    gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if [ "${gpus:-0}" -ge 2 ]; then
        step tp 150 python $ROOT/benchmarks/tp_bytes.py --device cuda --world 2 --out "$OUT/tp_bytes.json"
    else
        log "skip tp: NCCL tensor parallelism needs 2 GPUs, this machine has ${gpus:-0}"
    fi
fi
log "done; $(left) s of the budget left"
