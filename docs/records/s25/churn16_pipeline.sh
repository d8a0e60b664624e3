#!/bin/bash
# Session 25: the 16-node churn run on today's main (the --average-clock 60 default since session 24)
cd /work/main
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)"
env OMP_NUM_THREADS=1 BT_CHURN_MINUTES=5 BT_RELIABILITY_LOG=/work/tools/s25/churn16.jsonl \
    /work/venv/bin/python -m pytest -n 0 -s -p no:randomly tests/test_churn16.py > /work/tools/s25/churn16.log 2>&1
echo "rc $? end $(date -u +%FT%TZ)"
