#!/bin/bash
# Session 24: initdiag.py's base init for seeds 2 and 0 on today's code (session 17's records were
# made at 03f5e12 and today's code reads 2.4763 against their 2.4657 at step 300 of init 2: not like
# for like), 2,400 steps each, two at a time under the heavy lock.
OUT=${OUT:-/work/tools}
cd "$(dirname "$0")"
flock /work/tools/heavy.lock bash -c '
  OUT=$1; echo "start $(date -u +%FT%TZ) $(git -C /work/main rev-parse --short HEAD) load $(cut -d" " -f1-3 /proc/loadavg)"
  python initdiag.py base 2 1 2400 $OUT/s24_init_base2.json > $OUT/s24_init_base2.log 2>&1 &
  python initdiag.py base 0 1 2400 $OUT/s24_init_base0.json > $OUT/s24_init_base0.log 2>&1 &
  trap "kill 0" TERM INT
  wait; echo "end $(date -u +%FT%TZ)"' _ $OUT
