#!/usr/bin/env bash
# CPU cost of the node's 4 MiB mmap pin at d768: bench memory block 1, allocators alternated; quiet machine
cd /work/main
i=0
for A in node glibc glibc node; do
  i=$((i+1))
  echo "$i $A start $(date -u +%H:%M:%S)" >> /work/tools/cpu19.times
  /work/venv/bin/bt-node bench memory --objective pipeline --set d_model=768 --set n_heads=12 --set layers_per_block=3 \
    --set n_blocks=4 --set seq_len=256 --set batch_size=16 --set target_dim=16 --steps 2 --threads 1 \
    --device cpu --json --block 1 --inflight 4 --no-weight-stash --recompute --allocator $A \
    > /work/tools/cpu19_${i}_$A.json 2> /work/tools/cpu19_${i}_$A.err
  echo "$i $A end $(date -u +%H:%M:%S) rc=$?" >> /work/tools/cpu19.times
done
