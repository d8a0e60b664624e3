#!/usr/bin/env bash
# Session 38: target 3 like for like (block and whole model both checkpoint their layers), at the engine's
# defaults (1 micro-batch in flight, no weight copies), at two model sizes: the d_model 768 x 12-layer model of session 21 and a
# d_model 1280 x 24-layer one. Offline `bt-node bench memory` (each module in its own fresh process).
# Run: OMP_NUM_THREADS=1 flock /work/tools/heavy.lock bash docs/records/s38/mem38.sh OUTDIR
set -u
OUT=${1:?outdir}; mkdir -p "$OUT"; T=$OUT/mem38.times
COMMON="--objective pipeline --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16 --steps 2 --threads 1 --device cpu --json --no-weight-stash --layer-checkpoint --reference-layer-checkpoint"
run() { n=$1; shift; echo "$n start $(date -u +%H:%M:%S)" >> "$T"
  bt-node bench memory $COMMON "$@" > "$OUT/$n.json" 2> "$OUT/$n.err"; echo "$n end $(date -u +%H:%M:%S) rc=$?" >> "$T"; }
echo "commit $(git -C "$(dirname "$0")" rev-parse --short HEAD)" >> "$T"
run d768_b1 --set d_model=768 --set n_heads=12 --set layers_per_block=3 --block 1
run d1280_b1 --set d_model=1280 --set n_heads=20 --set layers_per_block=6 --block 1
run d1280_b3 --set d_model=1280 --set n_heads=20 --set layers_per_block=6 --block 3
