#!/usr/bin/env bash
# real workers: bench pipeline, for each arg (base|s19); a 1-s sampler of the workers' VmRSS/VmHWM
for W in "$@"; do
  if [ $W = base ]; then PP=/work/baseshim; D=/work/base; else PP=; D=/work/main; fi
  echo "$W start $(date -u +%H:%M:%S)" >> /work/tools/real20.times
  ( while true; do for p in $(pgrep -f -- "--block [0-9]"); do
      c=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -o -- "--block [0-9]*")
      r=$(awk '/VmRSS|VmHWM/{print $2}' /proc/$p/status 2>/dev/null | tr '\n' ' ')
      echo "$(date +%s) $p $r $c"; done; sleep 1; done ) > /work/tools/sampler_$W.log 2>&1 &
  S=$!
  cd $D && PYTHONPATH=$PP /work/venv/bin/bt-node bench pipeline --objective pipeline --layout 0,1,2,3 --train-seconds 150 \
    --no-serving --no-references --inflight 4 --flush --recompute --eval-windows 16 --set d_model=768 --set n_heads=12 \
    --set layers_per_block=3 --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16 \
    --data /work/shared/data/gutenberg --json > /work/tools/real20_$W.json 2> /work/tools/real20_$W.err
  rc=$?
  kill $S
  echo "$W end $(date -u +%H:%M:%S) rc=$rc" >> /work/tools/real20.times
done
