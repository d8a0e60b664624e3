#!/bin/bash
# tests/test_churn16_paper_tmp.py was a copy of tests/test_churn16.py whose overrides add "objective=paper" (not kept)
cd /work/main
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)"
env OMP_NUM_THREADS=1 BT_CHURN_MINUTES=5 BT_RELIABILITY_LOG=/work/tools/s25/churn16_paper.jsonl \
    /work/venv/bin/python -m pytest -n 0 -s tests/test_churn16_paper_tmp.py > /work/tools/s25/churn16_paper.log 2>&1
echo "rc $? end $(date -u +%FT%TZ)"
