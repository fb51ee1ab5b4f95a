#!/usr/bin/env bash
# baft's CUDA path on one GPU, as one prepared run (the GPU check; also runs on CPU).
#
#   OUT=runs/cuda-check benchmarks/cuda_check.sh
#
# 1. the CUDA snapshot copy (benchmarks/cuda_copy.py): host cost, GB/s, effect on matmuls,
#    host hashing rate;
# 2. single-rank training on the GPU (`baft train`, small model): a run without
#    checkpoints, one with full snapshots and one with differential ones (full_every=4),
#    the latter two killed at iteration 14 and restored from memory; all must end on the
#    same state digest (a bit-identical trajectory);
# 3. the same three modes, no failure, on a larger model (the GPU bounds the iteration);
# 4. the unit tests that take a CUDA path when one is present.
# OUT/check.json sums it up (benchmarks/cuda_summary.py); OUT/runs.tgz holds every run's
# metrics and timelines. Each step is bounded; the log says ok/FAILED per step.
set -u
OUT=${OUT:-runs/cuda-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
PY=${PY:-python3}
STORES=/dev/shm/baft-cuda-check
SMALL=${SMALL:-"--layers 8 --d-model 512 --heads 8 --seq-len 64 --batch 8 --iterations 24"}
LARGE=${LARGE:-"--layers 8 --d-model 1024 --heads 16 --seq-len 512 --batch 32 --iterations 16"}
failed=0

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T)): $*"
    LIMIT=$limit  # a function (train) bounds its own command with it
    local rc=0
    if [ "$(type -t "$1")" = function ]; then "$@" || rc=$?; else timeout "$limit" "$@" || rc=$?; fi
    if [ $rc = 0 ]; then
        echo "=== $name: ok"
    else
        echo "=== $name: FAILED (exit $rc)"
        failed=$((failed + 1))
    fi
}

train() {  # train NAME ARGS... : one single-rank `baft train` run on this machine's device
    local name=$1
    shift
    rm -rf "${OUT:?}/$name" "$STORES-$name"
    timeout "$LIMIT" $PY -m baft.cli train --dp 1 --pp 1 --microbatches 2 --max-restarts 2 \
        --timeout 60 --out "$OUT/$name" --store-root "$STORES-$name" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 2 "$OUT/$name.log"
    return $rc
}

FULL="every=1,redundancy=none,persist=8,full_every=1"
DIFF="every=1,redundancy=none,persist=0,full_every=4"
step env 60 $PY -c "import torch, xxhash, zfec, rich; print(torch.__version__, \
torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
step copy 120 sh -c "$PY benchmarks/cuda_copy.py --gib 2 > $OUT/cuda_copy.json"
step small-none 120 train none $SMALL --no-checkpoint
step small-full 150 train full $SMALL --checkpoint $FULL --inject kill:rank=0,iter=14
step small-diff 150 train diff $SMALL --checkpoint $DIFF --inject kill:rank=0,iter=14
step large-none 120 train large-none $LARGE --no-checkpoint
step large-full 120 train large-full $LARGE --checkpoint $FULL
step large-diff 120 train large-diff $LARGE --checkpoint $DIFF
step summary 30 $PY benchmarks/cuda_summary.py "$OUT"
(cd "$OUT" && tar czf runs.tgz ./*/metrics.jsonl ./*/timeline ./*/summary.json ./large-none/logs 2>/dev/null)
if [ "${UNIT:-1}" = 1 ]; then  # UNIT=0 leaves them out
    step unit 240 $PY -m pytest -q -p no:cacheprovider tests/unit/test_device_copy.py \
        tests/unit/test_replay.py tests/unit/test_watchdog.py
fi
rm -rf "$STORES"-*
echo "=== $failed step(s) failed"
exit $failed
