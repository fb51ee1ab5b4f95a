#!/usr/bin/env bash
# The GPU suite in one command (about 8 minutes; see benchmarks/gpu_suite.py):
#
#   bash benchmarks/gpu_suite.sh [--minutes 8] [--out DIR] [--dry-run] [--gpus N]
#
# Runs from the repository root; PY picks the interpreter (default python3).
# Then, unless BAFT_GPU_TITAN=0: torchtitan 0.3.0's own Trainer (llama3 debugmodel, FlexAttention,
# PP=2 x FSDP2 over the GPUs) with BaftCheckpointManager, against the same run without baft
# (tests/e2e/titan_train.py; every rank's model/optimizer/scheduler/data/RNG hashes must match).
# It needs torchtitan installed and 2+ GPUs (PP=2; NCCL refuses two ranks on one GPU); it says
# SKIP otherwise. On CPU the same Trainer runs in tests/e2e/test_torchtitan_real.py.
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
PY=${PY:-python3}
"$PY" benchmarks/gpu_suite.py --python "$PY" "$@"
rc=$?
case " $* " in *" --dry-run "*) exit $rc ;; esac
[ "${BAFT_GPU_TITAN:-1}" = 0 ] && exit $rc

ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if ! "$PY" -c 'import torchtitan' 2>/dev/null; then
    echo "torchtitan Trainer: SKIP (torchtitan not installed: pip install torchtitan==0.3.0)"
    exit $rc
fi
if [ "$ngpu" -lt 2 ]; then
    echo "torchtitan Trainer: SKIP ($ngpu GPU(s); PP=2 needs 2)"
    exit $rc
fi
out=$(mktemp -d /tmp/baft-titan-gpu.XXXXXX)
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # torchtitan's debug.deterministic on CUDA
titan() {  # NAME MAX_RESTARTS [-m baft.inprocess] -- [script flags]
    local name=$1 restarts=$2; shift 2
    local pre=(); while [ "$1" != -- ]; do pre+=("$1"); shift; done; shift
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" --redirects 3 \
        --log-dir "$out/$name-logs" --max-restarts "$restarts" "${pre[@]}" \
        tests/e2e/titan_train.py --out "$out/$name" --assets "$out/assets" --pp 2 --steps 12 \
        --ranks-per-node "$ngpu" --store-root /dev/shm/baft-titan-gpu "$@"
}
"$PY" tests/e2e/titan_train.py --make-assets --out "$out" --assets "$out/assets" &&
    titan ref 0 -- --unprotected &&
    titan run 3 -m baft.inprocess -- &&
    "$PY" - "$out" "$ngpu" <<'PYEOF'
import json, sys
out, world = sys.argv[1], int(sys.argv[2])
def load(run, r):
    s = json.load(open(f"{out}/{run}/state.rank{r}.json")); s.pop("pid"); return s
bad = [r for r in range(world) if load("ref", r) != load("run", r)]
print(f"torchtitan Trainer with baft on {world} GPUs: " + ("bit-identical to the run without baft" if not bad else f"DIFFERS on ranks {bad}"))
sys.exit(1 if bad else 0)
PYEOF
trc=$?
echo "torchtitan Trainer: outputs in $out (rc $trc)"
[ $rc -ne 0 ] && exit $rc
exit $trc
