#!/bin/bash
# issue 29: baft bench overhead --compute emulated before (9cb7ceb) and after (the renovation), same args, back to back
ARGS="overhead --compute emulated --emulated-ms 15.7/29.4,15.2/28.4 --modes none,naive-async,baft-full,baft --blocks 8 --block-iters 4 --switch-iters 1 --warmup 2 --ranks-per-node 1 --seed 0 --no-results --json"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
cd /work/wt/base && PYTHONPATH=/work/wt/base /work/main/.venv/bin/python -m baft.cli bench $ARGS --out /tmp/b29-before > /tmp/b29-before.json 2> /tmp/b29-before.err; echo "before rc=$?"
cd /work/wt/after && PYTHONPATH=/work/wt/after:/work/wt/after/benchmarks /work/main/.venv/bin/python -m baft.cli bench $ARGS --out /tmp/b29-after > /tmp/b29-after.json 2> /tmp/b29-after.err; echo "after rc=$?"
