#!/bin/bash
# run 30: run 26/27's command (40 minutes) with --seed 2, on e576897 (the data order now seeded: worker i draws stream i)
cd /tmp
echo "start $(date -u +%T)" > /work/tools/run30.times
OMP_NUM_THREADS=1 timeout -s TERM 8400 /tmp/ci106.venv/bin/bt-node bench pipeline \
    --objective pipeline --layout 0,1,2,3 --train-seconds 2400 --no-serving --no-whole-reference \
    --inflight 4 --flush --lr pipeline=4e-3 --lr one_block=4e-3 --lr-schedule cosine --seed 2 \
    --data /work/shared/data/gutenberg --record /work/tools/run30.json > /work/tools/run30.out 2> /work/tools/run30.err
echo "end $(date -u +%T) rc=$?" >> /work/tools/run30.times
