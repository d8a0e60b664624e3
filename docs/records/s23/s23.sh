#!/usr/bin/env bash
# session 23: a d_model-768 pipeline on 2 cores (s22r.sh's arm N: layout 0,1,1,2,3, --average-every 1,
# 4 in flight, flush, recompute, layer checkpoint, 360 s) with the adaptive micro-batch budget (arm B,
# this branch) and without it (arm O: main before it, from a clone at /work/s21 through the namespace
# shim /work/s21shim). Interleaved B O B O as far as ARGS allow. Run under the heavy lock:
#   flock /work/tools/heavy.lock docs/records/s23/s23.sh B O
export OMP_NUM_THREADS=1
T=/work/tools/s23.times
SHAPE="--objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16"
echo "commit $(cd /work/main && git rev-parse --short HEAD); old $(cd /work/s21 && git rev-parse --short HEAD)" >> $T
i=0
for arm in "$@"; do i=$((i+1)); n="${arm}$i"
  if [ "$arm" = O ]; then export PYTHONPATH=/work/s21shim; else unset PYTHONPATH; fi
  echo "$n start $(date -u +%H:%M:%S)" >> $T
  /work/venv/bin/bt-node bench pipeline --layout 0,1,1,2,3 --average-every 1 --train-seconds 360 --no-serving \
    --no-references --inflight 4 --flush --recompute --layer-checkpoint --eval-windows 16 $SHAPE \
    --data /work/shared/data/gutenberg --json > /work/tools/s23_$n.json 2> /work/tools/s23_$n.err
  echo "$n end $(date -u +%H:%M:%S) rc=$?" >> $T
done
