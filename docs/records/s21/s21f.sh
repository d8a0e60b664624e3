#!/usr/bin/env bash
# session 21, second pass (our own layer checkpoint, 980c652): offline and real workers
export OMP_NUM_THREADS=1
T=/work/tools/s21.times
cd /work/main
SHAPE="--objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16"
run_mem() { n=$1; shift; echo "$n start $(date -u +%H:%M:%S)" >> $T; /work/venv/bin/bt-node bench memory $SHAPE --steps 2 --threads 1 --device cpu --json --inflight 4 --no-weight-stash "$@" > /work/tools/s21_$n.json 2> /work/tools/s21_$n.err; echo "$n end $(date -u +%H:%M:%S) rc=$?" >> $T; }
run_real() { n=$1; shift
  echo "$n start $(date -u +%H:%M:%S)" >> $T
  ( while true; do for p in $(pgrep -f -- "--block [0-9]"); do
      c=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -o -- "--block [0-9]*")
      r=$(awk '/VmRSS|VmHWM/{print $2}' /proc/$p/status 2>/dev/null | tr '\n' ' ')
      echo "$(date +%s) $p $r $c"; done; sleep 1; done ) > /work/tools/sampler21_$n.log 2>&1 &
  S=$!
  /work/venv/bin/bt-node bench pipeline --layout 0,1,2,3 --train-seconds 150 --no-serving --no-references --inflight 4 --flush \
    --eval-windows 16 $SHAPE --data /work/shared/data/gutenberg --json "$@" > /work/tools/s21_$n.json 2> /work/tools/s21_$n.err
  rc=$?; kill $S
  echo "$n end $(date -u +%H:%M:%S) rc=$rc" >> $T; }
echo "commit $(git rev-parse --short HEAD)" >> $T
run_real B3 --recompute --layer-checkpoint
