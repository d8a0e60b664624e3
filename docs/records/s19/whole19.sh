#!/usr/bin/env bash
# the whole-size model (12 layers, one block) trained by ONE real node, same shape and settings as real19
cd /work/main
echo "whole start $(date -u +%H:%M:%S)" >> /work/tools/whole19.times
( while true; do for p in $(pgrep -f -- "--block [0-9]"); do
    r=$(awk '/VmRSS|VmHWM/{print $2}' /proc/$p/status 2>/dev/null | tr '\n' ' ')
    echo "$(date +%s) $p $r --block 0"; done; sleep 1; done ) > /work/tools/sampler_whole.log 2>&1 &
S=$!
/work/venv/bin/bt-node bench pipeline --objective pipeline --layout 0 --train-seconds 150 \
  --no-serving --no-references --inflight 4 --flush --recompute --eval-windows 16 --set d_model=768 --set n_heads=12 \
  --set layers_per_block=12 --set n_blocks=1 --set seq_len=256 --set batch_size=16 --set target_dim=16 \
  --data /work/shared/data/gutenberg --json > /work/tools/whole19.json 2> /work/tools/whole19.err
rc=$?
kill $S
echo "whole end $(date -u +%H:%M:%S) rc=$rc" >> /work/tools/whole19.times
cd /work/main && OMP_NUM_THREADS=1 /work/venv/bin/bt-node bench node-memory --layout after --layout after \
  --data /work/shared/data/wikitext-2-raw --settle 30 --samples 5 --interval 2 --json > /work/tools/nodemem19.json 2> /work/tools/nodemem19.err
echo "nodemem end $(date -u +%H:%M:%S) rc=$?" >> /work/tools/whole19.times
