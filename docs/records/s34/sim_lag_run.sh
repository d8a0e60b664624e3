#!/bin/bash
# record lag sensitivity: calibrated timings, harsh churn, 32 blocks; "oc" = this tree with the switch check of 66f9257
. /work/venv/bin/activate
cd /tmp/simcmp
cal="--download-median-s 43.7 --round-window-s 9.54 --hop-failure 0.0094"
run() { name=$1; pp=$2; shift 2; s=$(date +%s)
  PYTHONPATH=$pp OMP_NUM_THREADS=1 bt-node bench simulate --blocks 32 --churn harsh --json "$@" > lag_$name.json 2> lag_$name.err
  echo "$name rc=$? $(( $(date +%s)-s ))s $(date -u +%H:%M:%S)" >> lagprogress.txt; }
for seed in 0 10; do
  run both_l2_s$seed "" --seeds 5 --seed $seed --policy both --record-lag-s 2 $cal
  run both_l5_s$seed "" --seeds 5 --seed $seed --policy both --record-lag-s 5 $cal
  run oc_l5_s$seed /tmp/simoc_pkg --seeds 5 --seed $seed --policy rebalance --record-lag-s 5 $cal
done
echo done >> lagprogress.txt
