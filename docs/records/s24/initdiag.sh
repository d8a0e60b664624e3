#!/bin/bash
# Session 24: depth-aware init, in-process chain (initdiag.py), under the heavy lock once the benches are done.
# scaled init seeds 2 (session 17's worst, 1.6536) and 0 (1.6357) for 2,400 steps, beside a 300-step
# base run of init 2 (reproduces session 17's curve point: ce256 2.4657 at step 300?).
OUT=${OUT:-/work/tools}
cd "$(dirname "$0")"
flock /work/tools/heavy.lock bash -c '
  OUT=$1; echo "start $(date -u +%FT%TZ) $(git -C /work/main rev-parse --short HEAD) load $(cut -d" " -f1-3 /proc/loadavg)"
  python initdiag.py base 2 1 300 $OUT/s24_init_base2_300.json > $OUT/s24_init_base2_300.log 2>&1 &
  python initdiag.py scaled 2 1 2400 $OUT/s24_init_scaled2.json > $OUT/s24_init_scaled2.log 2>&1 &
  python initdiag.py scaled 0 1 2400 $OUT/s24_init_scaled0.json > $OUT/s24_init_scaled0.log 2>&1 &
  trap "kill 0" TERM INT
  wait; echo "end $(date -u +%FT%TZ)"' _ $OUT
