#!/bin/bash
# Session 25: target 5's comparison (runs 9 and 10: pipeline vs paper, 720 s, layout 0,1,2,3) with a second seed,
# both objectives in ONE bench invocation (same machine state, pipeline first), seed $1.
S=${1:-1}
OUT=/work/tools/s25
cd /work/main
. /work/venv/bin/activate
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD) seed $S load $(cut -d' ' -f1-3 /proc/loadavg)"
OMP_NUM_THREADS=1 timeout -s TERM 2400 bt-node bench pipeline --objective pipeline --objective paper \
    --layout 0,1,2,3 --train-seconds 720 --curve-every 90 --no-serving --no-references --seed $S \
    --data /work/shared/data/gutenberg --workdir /tmp/t5w$S --record $OUT/s25_target5_seed$S.json --json \
    > $OUT/s25_target5_seed$S.out 2> $OUT/s25_target5_seed$S.err
echo "rc $? end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
