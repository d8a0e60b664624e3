#!/usr/bin/env bash
# A round's memory peak, old code (3e4a883, a clone at /work/s21 reached through the namespace shim
# /work/s21shim) against this branch (the editable install at /work/main), interleaved, 3 runs each.
# Run under the heavy lock: flock /work/tools/heavy.lock docs/records/s22/s22.sh > docs/records/s22/roundpeak.jsonl
set -u
cd "$(dirname "$0")/../../.."
for run in 1 2 3; do
  for obj in pipeline paper; do
    for code in old new; do
      if [ $code = old ]; then export PYTHONPATH=/work/s21shim; else unset PYTHONPATH; fi
      line=$(/work/venv/bin/python docs/records/s22/roundpeak.py 768 $obj 2>/dev/null | grep '^{')
      echo "{\"code\": \"$code\", \"run\": $run, \"utc\": \"$(date -u +%H:%M:%S)\", ${line#\{}"
    done
  done
done
unset PYTHONPATH
