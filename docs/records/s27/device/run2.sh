#!/bin/bash
# Device, the pipeline side of issue 13 target 6: `bt-node bench pipeline --preset h200` cut to the time
# left (argument 1, seconds): the preset's objectives, workers, model, compression and in-flight count,
# no serving networks (their cost is hop delay, not the device), as many objectives as fit.
set -u
LEFT=${1:?seconds left}
T0=$(date +%s)
el() { echo "[p+$(( $(date +%s) - T0 ))s] $*"; }
if [ ! -x /tmp/site/bin/bt-node ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
fi
if [ ! -s /tmp/data/gutenberg/train.txt ]; then
  mkdir -p /tmp/data/gutenberg && tar -xJf .gpu/data/gutenberg.tar.xz -C /tmp/data/gutenberg || exit 5
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# plans (bench/pipeline.py plan_seconds, no serving): 3 objectives 345 s, 2: 260 s, 1: 175 s; x1.25 margin
if   [ "$LEFT" -ge 430 ]; then OBJ="--objective pipeline --objective forward-streamed --objective paper"
elif [ "$LEFT" -ge 325 ]; then OBJ="--objective pipeline --objective paper"
elif [ "$LEFT" -ge 220 ]; then OBJ="--objective pipeline"
else el "only $LEFT s left: bench pipeline not started"; exit 0; fi
el "bench pipeline --preset h200 ($OBJ, --no-serving), $LEFT s left, start $(date -u +%H:%M:%S)"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,clocks.sm,power.draw --format=csv -l 10 >> "$OUT/gpu_util.csv" 2>&1 &
SMI=$!
timeout -s INT -k 30 $(( LEFT - 15 )) bt-node bench pipeline --preset h200 $OBJ --no-serving --data /tmp/data/gutenberg \
  --workdir /tmp/pw --json > "$OUT/pipeline.json" 2> "$OUT/pipeline.err"
RC=$?
kill $SMI 2>/dev/null
el "bench pipeline --preset h200: rc=$RC"
tail -40 "$OUT/pipeline.err"
