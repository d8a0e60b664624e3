#!/bin/bash
# Device call 1 (issue 13 target 6): set up, smoke-test both GPU paths at tiny size, then
# `bt-node bench quality --preset h200` on gutenberg-offline. Everything lands in $OUT.
set -u
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
exec > >(tee "$OUT/run1.log") 2>&1
el "start $(date -u)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc; free -g | head -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || { el "pip failed"; exit 3; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
python3 -c "import sys, torch, hivemind, blocktrain.blocks; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), hivemind.__version__)" || exit 4
mkdir -p /tmp/data/gutenberg && tar -xJf .gpu/data/gutenberg.tar.xz -C /tmp/data/gutenberg || exit 5
(cd /tmp/data/gutenberg && sha256sum train.txt test.txt)
el "setup done"

TINY="--set d_model=32 --set n_heads=2 --set layers_per_block=1 --set n_blocks=2 --set seq_len=32 --set target_dim=8 --set batch_size=4 --set warmup_steps=2"
bt-node bench quality --data tests/data/lord-arthur-savile --preset tiny --device cuda --out /tmp/smoke_q --json \
  > /tmp/smoke_q.json 2> /tmp/smoke_q.err &
PQ=$!
bt-node bench pipeline --preset h200 --objective pipeline --layout 0,1,1 --train-seconds 8 --no-references --no-serving \
  --data tests/data/lord-arthur-savile $TINY --workdir /tmp/smoke_pw --json > /tmp/smoke_p.json 2> /tmp/smoke_p.err &
PP=$!
wait $PQ; RQ=$?; el "smoke quality (tiny, cuda) rc=$RQ"; tail -4 /tmp/smoke_q.err
wait $PP; RP=$?; el "smoke pipeline (h200 preset at tiny size, cuda) rc=$RP"; tail -4 /tmp/smoke_p.err
python3 - <<'EOF'
import json
try:
    r = json.load(open("/tmp/smoke_p.json"))["runs"]["pipeline"]
    print("smoke pipeline chain_ce", r["chain_ce"], "init", r["chain_ce_init"], "microbatches", r["microbatches_completed"])
except Exception as e:
    print("smoke pipeline: no result", e)
EOF
tar -czf "$OUT/smoke.tgz" -C /tmp smoke_q.err smoke_p.err smoke_q.json smoke_p.json 2>/dev/null
[ "$RQ" = 0 ] || { el "quality smoke failed: not starting the full run"; exit 6; }

nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,clocks.sm,power.draw --format=csv -l 15 > "$OUT/gpu_util.csv" 2>&1 &
SMI=$!
el "bench quality --preset h200: start $(date -u +%H:%M:%S)"
TQ=$(date +%s)
timeout -s INT -k 25 ${QUALITY_LIMIT_S:-500} bt-node bench quality --data /tmp/data/gutenberg --preset h200 --out /tmp/q --json \
  > "$OUT/quality.json" 2> "$OUT/quality.err"
RC=$?
el "bench quality --preset h200: rc=$RC, wall $(( $(date +%s) - TQ )) s"
kill $SMI 2>/dev/null
tail -30 "$OUT/quality.err"
tar -czf "$OUT/quality_study.tgz" -C /tmp q
el "end $(date -u)"

LEFT=$(( T0 + ${CALL_LIMIT_S:-590} - 12 - $(date +%s) ))
el "time left in this call: $LEFT s"
bash .gpu/run2.sh "$LEFT"
el "all done $(date -u)"
