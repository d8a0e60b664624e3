#!/bin/bash
# Session 25: depth-aware init, in-process chain (docs/records/s24/initdiag.py), the two seeds session 24 left:
# scaled init seeds 1 and 3 for 2,400 steps (base runs of these seeds: session 17's diag_init1/3.json).
OUT=${OUT:-/work/tools/s25}
cd /work/main/docs/records/s24
flock /work/tools/heavy.lock bash -c '
  OUT=$1; echo "start $(date -u +%FT%TZ) $(git -C /work/main rev-parse --short HEAD) load $(cut -d" " -f1-3 /proc/loadavg)"
  trap "kill 0" TERM INT
  python initdiag.py scaled 1 1 2400 $OUT/s25_init_scaled1.json > $OUT/s25_init_scaled1.log 2>&1 &
  python initdiag.py scaled 3 1 2400 $OUT/s25_init_scaled3.json > $OUT/s25_init_scaled3.log 2>&1 &
  wait; echo "end $(date -u +%FT%TZ)"' _ $OUT
