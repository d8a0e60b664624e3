#!/usr/bin/env bash
# session 22: real workers of a replicated block averaging at d768 (layout 0,1,1,2,3, --average-every 1),
# with a 1-s sampler of every worker's VmRSS / VmHWM. Run under the heavy lock.
#   s22r.sh              arm N (this branch), then arm O (the old averaging code: node/ and p2p/ of
#                        3e4a883 from a clone at /work/s21, bench/ cli/ blocks/ of this branch, through
#                        the namespace shim /work/s22mix)
#   s22r.sh NAME ARGS..  one arm named NAME with more bench arguments (s22c.sh: C --average-clock 30)
export OMP_NUM_THREADS=1
T=/work/tools/s22.times
SHAPE="--objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16"
run_real() { n=$1; shift
  echo "$n start $(date -u +%H:%M:%S)" >> $T
  ( while true; do for p in $(pgrep -f -- "--block [0-9]"); do
      c=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -o -- "--block [0-9]*")
      r=$(awk '/VmRSS|VmHWM/{print $2}' /proc/$p/status 2>/dev/null | tr '\n' ' ')
      echo "$(date +%s) $p $r $c"; done; sleep 1; done ) > /work/tools/sampler22_$n.log 2>&1 &
  S=$!
  /work/venv/bin/bt-node bench pipeline --layout 0,1,1,2,3 --average-every 1 --train-seconds 360 --no-serving \
    --no-references --inflight 4 --flush --recompute --layer-checkpoint --eval-windows 16 $SHAPE \
    --data /work/shared/data/gutenberg --json "$@" > /work/tools/s22_$n.json 2> /work/tools/s22_$n.err
  rc=$?; kill $S
  echo "$n end $(date -u +%H:%M:%S) rc=$rc" >> $T; }
echo "commit $(cd /work/main && git rev-parse --short HEAD); old node/p2p $(cd /work/s21 && git rev-parse --short HEAD)" >> $T
if [ $# -gt 0 ]; then unset PYTHONPATH; run_real "$@"; exit; fi
unset PYTHONPATH; run_real N
PYTHONPATH=/work/s22mix run_real O
