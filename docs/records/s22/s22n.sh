#!/usr/bin/env bash
# session 22: roundnode.py (a round's peak in real node processes), this branch (new) against the old
# averaging code (old: node/ and p2p/ of 3e4a883 through the namespace shim /work/s22mix), interleaved,
# two runs each. Run under the heavy lock: ... > docs/records/s22/roundnode.jsonl
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
for run in 1 2; do
  for code in new old; do
    rm -rf /tmp/rn22
    if [ $code = old ]; then export PYTHONPATH=/work/s22mix; else unset PYTHONPATH; fi
    line=$(/work/venv/bin/python docs/records/s22/roundnode.py /tmp/rn22 2>/dev/null | grep '^{')
    echo "{\"code\": \"$code\", \"run\": $run, ${line#\{}"
  done
done
rm -rf /tmp/rn22
