#!/bin/bash
# Session 46: run 33's one-block wall-time reference, started as soon as runs 31 and 32's (wallrefs.sh) have both
# ended, alone on the machine (the same clone and venv on 5855684).
cd /tmp
until grep -q end /work/tools/wall31.times 2>/dev/null && grep -q end /work/tools/wall32.times 2>/dev/null; do sleep 5; done
echo "start $(date -u +%T)" > /work/tools/wall33.times
OMP_NUM_THREADS=1 timeout -s TERM 7200 /tmp/wref.venv/bin/bt-node bench pipeline-wall-reference \
    /work/main/docs/records/run33.jsonl --record /work/tools/run33-wall.jsonl \
    > /work/tools/wall33.out 2> /work/tools/wall33.err
echo "end $(date -u +%T) rc=$?" >> /work/tools/wall33.times
