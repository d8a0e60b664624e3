#!/bin/bash
# run 31: run 29/30's command (seed 2, the data order seeded) at 80 minutes, on 271a453 (CI 116's clone and
# venv); the one-block reference on one worker's CPU budget only (--no-wall-reference: the wall-time reference
# would add 80 minutes, which no 3-hour session fits beside the chain)
cd /tmp
echo "start $(date -u +%T)" > /work/tools/run31.times
OMP_NUM_THREADS=1 timeout -s TERM 9000 /tmp/ci116.venv/bin/bt-node bench pipeline \
    --objective pipeline --layout 0,1,2,3 --train-seconds 4800 --no-serving --no-whole-reference --no-wall-reference \
    --inflight 4 --flush --lr pipeline=4e-3 --lr one_block=4e-3 --lr-schedule cosine --seed 2 \
    --data /work/shared/data/gutenberg --record /work/tools/run31.json > /work/tools/run31.out 2> /work/tools/run31.err
echo "end $(date -u +%T) rc=$?" >> /work/tools/run31.times
