#!/bin/bash
# Final measurements of 2026-12-07: after (HEAD) and before (d8e572d + the bench's thread accounting), one after the other.
set -x
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
D=/work/main/benchmarks/results/attribution-2026-12-07
E="--compute emulated --emulated-ms 15.7/29.4,15.2/28.4 --switch-iters 1 --warmup 1"
cd /tmp/wt-final && PYTHONPATH=/tmp/wt-final:/tmp/wt-final/benchmarks /work/main/.venv/bin/python -m baft.cli bench overhead $E --block-iters 2 --modes none,baft,baft-shm,baft-full,naive-async,lm-resiliency --blocks 12 --out /tmp/runs/final-after --no-results --json > $D/final-after.json 2> $D/final-after.log; uptime >> $D/load.txt
cd /tmp/wt-base && PYTHONPATH=/tmp/wt-base:/tmp/wt-base/benchmarks /work/main/.venv/bin/python -m baft.cli bench overhead $E --block-iters 2 --modes none,baft,baft-shm,baft-full --blocks 8 --out /tmp/runs/final-before --no-results --json > $D/final-before.json 2> $D/final-before.log; uptime >> $D/load.txt
cd /tmp/wt-final && PYTHONPATH=/tmp/wt-final:/tmp/wt-final/benchmarks /work/main/.venv/bin/python -m baft.cli bench overhead $E --block-iters 20 --persist-every 20 --modes none,baft,baft-persist,baft-persist-proc,dcp-async --blocks 5 --no-restore-check --out /tmp/runs/final-persist20 --no-results --json > $D/final-persist20.json 2> $D/final-persist20.log; uptime >> $D/load.txt
