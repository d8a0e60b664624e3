#!/bin/bash
# run 33: run 31's command (docs/records/s43/run31.sh) with seed 1, on 9ddc5eb (its own clone and venv, so
# edits to the working tree cannot reach the spawned workers); the one-block reference on one worker's CPU
# budget only (--no-wall-reference: the wall-time reference would add 80 minutes)
cd /tmp
echo "start $(date -u +%T)" > /work/tools/run33.times
OMP_NUM_THREADS=1 timeout -s TERM 9000 /tmp/run33.venv/bin/bt-node bench pipeline \
    --objective pipeline --layout 0,1,2,3 --train-seconds 4800 --no-serving --no-whole-reference --no-wall-reference \
    --inflight 4 --flush --lr pipeline=4e-3 --lr one_block=4e-3 --lr-schedule cosine --seed 1 \
    --data /work/shared/data/gutenberg --record /work/tools/run33.json > /work/tools/run33.out 2> /work/tools/run33.err
rc=$?; echo "end $(date -u +%T) rc=$rc" >> /work/tools/run33.times
