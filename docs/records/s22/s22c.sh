#!/usr/bin/env bash
# session 22: s22r.sh's arm N again with --average-clock 30 (block 1's two replicas meet on the clock):
# a replicated d768 pipeline worker's peak with averaging rounds during training. Under the heavy lock.
export OMP_NUM_THREADS=1
T=/work/tools/s22.times
SHAPE="--objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16"
n=C
echo "commit $(cd /work/main && git rev-parse --short HEAD)" >> $T
echo "$n start $(date -u +%H:%M:%S)" >> $T
( while true; do for p in $(pgrep -f -- "--block [0-9]"); do
    c=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -o -- "--block [0-9]*")
    r=$(awk '/VmRSS|VmHWM/{print $2}' /proc/$p/status 2>/dev/null | tr '\n' ' ')
    echo "$(date +%s) $p $r $c"; done; sleep 1; done ) > /work/tools/sampler22_$n.log 2>&1 &
S=$!
/work/venv/bin/bt-node bench pipeline --layout 0,1,1,2,3 --average-every 1 --average-clock 30 --train-seconds 360 \
  --no-serving --no-references --inflight 4 --flush --recompute --layer-checkpoint --eval-windows 16 $SHAPE \
  --data /work/shared/data/gutenberg --json > /work/tools/s22_$n.json 2> /work/tools/s22_$n.err
rc=$?; kill $S
echo "$n end $(date -u +%H:%M:%S) rc=$rc" >> $T
