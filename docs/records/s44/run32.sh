#!/bin/bash
# run 32: run 31's command (docs/records/s43/run31.sh) with seed 0, on d9727a8 (its own clone and venv, so
# edits to the working tree cannot reach the spawned workers); the one-block reference on one worker's CPU
# budget only (--no-wall-reference: the wall-time reference would add 80 minutes)
cd /tmp
echo "start $(date -u +%T)" > /work/tools/run32.times
OMP_NUM_THREADS=1 timeout -s TERM 9000 /tmp/run32.venv/bin/bt-node bench pipeline \
    --objective pipeline --layout 0,1,2,3 --train-seconds 4800 --no-serving --no-whole-reference --no-wall-reference \
    --inflight 4 --flush --lr pipeline=4e-3 --lr one_block=4e-3 --lr-schedule cosine --seed 0 \
    --data /work/shared/data/gutenberg --record /work/tools/run32.json > /work/tools/run32.out 2> /work/tools/run32.err
echo "end $(date -u +%T) rc=$?" >> /work/tools/run32.times
