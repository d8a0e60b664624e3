#!/usr/bin/env bash
# Session 40: target 3 like for like (block and whole model both checkpoint their layers, 1 micro-batch in
# flight, no weight copies) at d_model 1280 x 24 layers (472M parameters), batch 16 x 256: session 38's
# attempt at this size passed the bench's 900-s limit per measurement; --timeout lifts it.
# Run: OMP_NUM_THREADS=1 bash docs/records/s40/mem40.sh OUTDIR   (a memory figure: other work may run beside it)
set -u
OUT=${1:?outdir}; mkdir -p "$OUT"; T=$OUT/mem40.times
COMMON="--objective pipeline --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16 --steps 2 --threads 1 --device cpu --json --no-weight-stash --layer-checkpoint --reference-layer-checkpoint --timeout 5400"
run() { n=$1; shift; echo "$n start $(date -u +%H:%M:%S)" >> "$T"
  bt-node bench memory $COMMON "$@" > "$OUT/$n.json" 2> "$OUT/$n.err"; echo "$n end $(date -u +%H:%M:%S) rc=$?" >> "$T"; }
echo "commit $(git -C "$(dirname "$0")" rev-parse --short HEAD)" >> "$T"
run d1280_b1 --set d_model=1280 --set n_heads=20 --set layers_per_block=6 --block 1
