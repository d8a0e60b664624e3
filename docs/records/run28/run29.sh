#!/bin/bash
# run 29: run 22/23's command (20 minutes) with --seed 2, on e576897 (the data order now seeded: worker i draws stream i)
cd /tmp
echo "start $(date -u +%T)" > /work/tools/run29.times
OMP_NUM_THREADS=1 timeout -s TERM 4800 /tmp/ci106.venv/bin/bt-node bench pipeline \
    --objective pipeline --layout 0,1,2,3 --train-seconds 1200 --no-serving --no-whole-reference \
    --inflight 4 --flush --lr pipeline=4e-3 --lr one_block=4e-3 --lr-schedule cosine --seed 2 \
    --data /work/shared/data/gutenberg --record /work/tools/run29.json > /work/tools/run29.out 2> /work/tools/run29.err
echo "end $(date -u +%T) rc=$?" >> /work/tools/run29.times
