#!/bin/bash
# run 28c: current code twice, run 22's chain settings (seed 1, cosine) for 480 s: A with fixed peer identities (q_new's), B with fresh ones
cd /tmp
V=/tmp/ci105.venv/bin
unset PYTHONPATH
for arm in "$@"; do
  W=/tmp/d28c_$arm; rm -rf $W
  if [ "$arm" = A ]; then for i in 0 1 2 3; do mkdir -p $W/pipeline/node$i/ckpt; cp /tmp/q_new/pipeline/node$i/ckpt/identity.key $W/pipeline/node$i/ckpt/; done; fi
  echo "== $arm start $(date -u +%T)" >> /tmp/diag28c.log
  OMP_NUM_THREADS=1 timeout -s TERM 1500 $V/bt-node bench pipeline --objective pipeline --layout 0,1,2,3 \
    --train-seconds 480 --no-serving --no-references --inflight 4 --flush --lr pipeline=4e-3 \
    --lr-schedule cosine --seed 1 --curve-every 120 --data /work/shared/data/gutenberg --workdir $W \
    --record /tmp/diag28c_$arm.json > /tmp/diag28c_$arm.out 2> /tmp/diag28c_$arm.err
  echo "== $arm rc=$? end $(date -u +%T)" >> /tmp/diag28c.log
done
