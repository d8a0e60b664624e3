#!/bin/bash
# Session 46: the one-block reference after the same wall time (80 minutes) for runs 31 and 32, side by side
# (two such references at once keep their steps: docs/records/s45/parallel_refs.py), on 5855684 in its own
# clone and venv (/tmp/wref, /tmp/wref.venv) so edits to the working tree cannot reach them.
cd /tmp
for R in 31 32; do
  ( echo "start $(date -u +%T)" > /work/tools/wall$R.times
    OMP_NUM_THREADS=1 timeout -s TERM 7200 /tmp/wref.venv/bin/bt-node bench pipeline-wall-reference \
        /work/main/docs/records/run$R.jsonl --record /work/tools/run$R-wall.jsonl \
        > /work/tools/wall$R.out 2> /work/tools/wall$R.err
    echo "end $(date -u +%T) rc=$?" >> /work/tools/wall$R.times ) &
done
wait
