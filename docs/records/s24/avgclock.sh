#!/bin/bash
# Session 24: what the default --average-clock 60 costs a fast chain (rounds already every 10 steps).
# bench pipeline, layout 0,1,1,2,3 (block 1 held twice), 300 s of training, the cpu preset, seed 0,
# gutenberg-offline; arms in the order 0, 60, 60, 0 (ABBA against drift), each under the heavy lock.
set -u
OUT=${OUT:-/work/tools}
for arm in 0 60 60 0; do
  flock /work/tools/heavy.lock bash -c '
    arm=$1; OUT=$2; tag=clock${arm}_$(date -u +%H%M%S)
    echo "$tag start $(date -u +%FT%TZ) $(git -C /work/main rev-parse --short HEAD) load $(cut -d" " -f1-3 /proc/loadavg)"
    OMP_NUM_THREADS=1 timeout -s TERM 1500 bt-node bench pipeline \
        --objective pipeline --layout 0,1,1,2,3 --train-seconds 300 --no-serving --no-references \
        --average-clock $arm --seed 0 --data /work/shared/data/gutenberg --record $OUT/s24_$tag.json \
        > $OUT/s24_$tag.log 2>&1
    echo "$tag end $(date -u +%FT%TZ) rc=$?"' _ $arm $OUT
done
