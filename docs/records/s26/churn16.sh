#!/bin/bash
# TAG=name OBJ=pipeline|paper MIN=minutes
cd /work/main
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD) dirty=$(git status --short | wc -l) obj ${OBJ:-pipeline} min ${MIN:-3} load $(cut -d' ' -f1-3 /proc/loadavg)"
env OMP_NUM_THREADS=1 BT_CHURN_OBJECTIVE=${OBJ:-pipeline} BT_CHURN_MINUTES=${MIN:-3} BT_RELIABILITY_LOG=/work/tools/s26/churn16_$TAG.jsonl \
    /work/venv/bin/python -m pytest -n 0 -s -p no:randomly tests/test_churn16.py > /work/tools/s26/churn16_$TAG.log 2>&1
echo "rc $? end $(date -u +%FT%TZ)"
