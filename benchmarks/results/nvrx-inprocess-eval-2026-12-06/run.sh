#!/bin/bash
# usage: run.sh SIGNAL  (KILL or STOP): 2 ranks by hand, signal rank 1 after 8 s, watch 40 s
cd /tmp/h4/nv; rm -f r0.log r1.log
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + RANDOM % 20000)) WORLD_SIZE=2 OMP_NUM_THREADS=1
RANK=0 LOCAL_RANK=0 timeout 90 /tmp/h4/nvrx/bin/python nvrx_eval.py > r0.log 2>&1 & P0=$!
RANK=1 LOCAL_RANK=1 timeout 90 /tmp/h4/nvrx/bin/python nvrx_eval.py > r1.log 2>&1 & P1=$!
for i in $(seq 1 600); do grep -q "step 3 " r1.log 2>/dev/null && break; sleep 0.1; done
echo "$(python3 -c 'import time;print(f"{time.monotonic():.3f}")') outside: SIG$1 rank1 (pid $(pgrep -P $P1 -f nvrx_eval | head -1))"
pkill -$1 -P $P1 -f nvrx_eval.py; # the python under timeout
sleep ${WATCH:-40}
kill -CONT $(pgrep -P $P1) 2>/dev/null
kill $P0 $P1 2>/dev/null; wait
