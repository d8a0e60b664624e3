#!/bin/bash
# usage: gcrun.sh FREEZE(0|1) SECONDS OUT
. /work/venv/bin/activate
cd "$(dirname "$0")" && rm -rf gcck_$1 && mkdir gcck_$1
export OMP_NUM_THREADS=1 GC_LOG=$3 BT_GC_FREEZE_PROBE=$1
python gc_passes.py seed --run-id gc$1 --data ../../../tests/data/lord-arthur-savile --set objective=paper \
  --set d_model=64 --set n_heads=2 --set layers_per_block=2 --set n_blocks=2 --set seq_len=64 \
  --checkpoint-dir gcck_$1 --port 0 --device cpu --quiet --http-port 0 > gcrun_$1.log 2>&1 &
pid=$!
sleep $2
kill -TERM $pid; wait $pid
cat $3; echo
