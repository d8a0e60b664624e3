#!/usr/bin/env bash
# bench memory at d768, s19 code (/work/main), blocks given as args; output /work/tools/mem19_b{B}.json
cd /work/main
for B in "$@"; do
  echo "b$B start $(date -u +%H:%M:%S)" >> /work/tools/mem19.times
  /work/venv/bin/bt-node bench memory --objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 \
    --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16 --steps 2 --threads 1 \
    --device cpu --json --block $B --inflight 4 --no-weight-stash --recompute --allocator node \
    > /work/tools/mem19_b$B.json 2> /work/tools/mem19_b$B.err
  echo "b$B end $(date -u +%H:%M:%S) rc=$?" >> /work/tools/mem19.times
done
