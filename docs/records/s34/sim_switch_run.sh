#!/bin/bash
# "old" ran the tree of 66f9257 from a git worktree at /tmp/simold, put first on sys.path through
# /tmp/simold_pkg/blocktrain -> /tmp/simold (PYTHONPATH beats the editable install of this checkout); "new" this checkout.
. /work/venv/bin/activate
cd /tmp/simcmp
common="--seeds 5 --blocks 32 --churn harsh --policy rebalance --json"
declare -A cfg
cfg[cal]="--download-median-s 43.7 --round-window-s 9.54 --hop-failure 0.0094"
cfg[pess]="--download-median-s 130 --move-median-s 59 --round-window-s 9.54 --hop-failure 0.0094"
cfg[src2]="--download-median-s 97.5 --round-window-s 22.6 --hop-failure 0.0123 --state-sources 2 --transfer-s 25"
for name in cal pess src2; do
  for seed in 0 10; do
    for code in old new; do
      pp=""; [ $code = old ] && pp=/tmp/simold_pkg
      s=$(date +%s)
      PYTHONPATH=$pp OMP_NUM_THREADS=1 bt-node bench simulate $common --seed $seed ${cfg[$name]} > ${name}_s${seed}_${code}.json 2> ${name}_s${seed}_${code}.err
      echo "$name seed$seed $code rc=$? $(( $(date +%s)-s ))s $(date -u +%H:%M:%S)" >> progress.txt
    done
  done
done
echo done >> progress.txt
