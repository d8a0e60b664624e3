#!/bin/bash
# run 28d: commit d4cc868 (--data-stream; the bench gives worker i stream i) twice, fresh peer identities each time,
# run 22's chain settings (seed 1, cosine) for 480 s: does a rerun with the same seed now give the same chain?
cd /tmp
V=/tmp/ci105.venv/bin
export PYTHONPATH=/tmp/s40pkg
for arm in "$@"; do
  W=/tmp/d28d_$arm; rm -rf $W
  echo "== $arm start $(date -u +%T)" >> /tmp/diag28d.log
  OMP_NUM_THREADS=1 timeout -s TERM 1500 $V/bt-node bench pipeline --objective pipeline --layout 0,1,2,3 \
    --train-seconds 480 --no-serving --no-references --inflight 4 --flush --lr pipeline=4e-3 \
    --lr-schedule cosine --seed 1 --curve-every 120 --data /work/shared/data/gutenberg --workdir $W \
    --record /tmp/diag28d_$arm.json > /tmp/diag28d_$arm.out 2> /tmp/diag28d_$arm.err
  echo "== $arm rc=$? end $(date -u +%T)" >> /tmp/diag28d.log
done
