#!/bin/bash
# run 28 diagnosis: run 22's chain command (seed 1) for 480 s on old code (23ec624) and current code, same VM, one after the other
cd /tmp
V=/tmp/ci105.venv/bin
for arm in "$@"; do
  if [ "$arm" = old ]; then export PYTHONPATH=/tmp/old22pkg; else unset PYTHONPATH; fi
  echo "== $arm start $(date -u +%T)" >> /tmp/diag28.log
  OMP_NUM_THREADS=1 timeout -s TERM 1500 $V/bt-node bench pipeline --objective pipeline --layout 0,1,2,3 \
    --train-seconds 480 --no-serving --no-references --inflight 4 --flush --lr pipeline=4e-3 \
    --lr-schedule cosine --seed 1 --curve-every 120 --data /work/shared/data/gutenberg \
    --record /tmp/diag28_$arm.json > /tmp/diag28_$arm.out 2> /tmp/diag28_$arm.err
  echo "== $arm rc=$? end $(date -u +%T)" >> /tmp/diag28.log
done
