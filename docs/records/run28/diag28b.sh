#!/bin/bash
# run 28b: old (23ec624) vs new code, the same peer identities (so the same data order), constant LR, 180 s, curve every 30 s
cd /tmp
V=/tmp/ci105.venv/bin
n=0
for arm in "$@"; do
  n=$((n+1))
  if [ "${arm%%_*}" = old ]; then export PYTHONPATH=/tmp/old22pkg; else unset PYTHONPATH; fi
  W=/tmp/d28b_$arm; rm -rf $W
  for i in 0 1 2 3; do mkdir -p $W/pipeline/node$i/ckpt; cp /tmp/q_new/pipeline/node$i/ckpt/identity.key $W/pipeline/node$i/ckpt/; done
  echo "== $arm start $(date -u +%T)" >> /tmp/diag28b.log
  OMP_NUM_THREADS=1 timeout -s TERM 900 $V/bt-node bench pipeline --objective pipeline --layout 0,1,2,3 \
    --train-seconds 180 --no-serving --no-references --inflight 4 --flush --lr pipeline=4e-3 \
    --lr-schedule constant --seed 1 --curve-every 30 --data /work/shared/data/gutenberg --workdir $W \
    --record /tmp/diag28b_$arm.json > /tmp/diag28b_$arm.out 2> /tmp/diag28b_$arm.err
  echo "== $arm rc=$? end $(date -u +%T)" >> /tmp/diag28b.log
done
