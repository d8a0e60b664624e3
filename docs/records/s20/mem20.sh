#!/usr/bin/env bash
# bench memory at d768, main code, --steps S for block 1; output /work/tools/mem20_s{S}.json
cd /work/main
for S in "$@"; do
  echo "s$S start $(date -u +%H:%M:%S)" >> /work/tools/mem20.times
  /work/venv/bin/bt-node bench memory --objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 \
    --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16 --steps $S --threads 1 \
    --device cpu --json --block 1 --inflight 4 --no-weight-stash --recompute --allocator node \
    > /work/tools/mem20_s$S.json 2> /work/tools/mem20_s$S.err
  echo "s$S end $(date -u +%H:%M:%S) rc=$?" >> /work/tools/mem20.times
done
