#!/bin/bash
# usage: bash docs/records/s28/gc_passes.sh FREEZE(0|1) SECONDS OUT.json   (in the project's venv)
# One lone training node (tiny paper run) under gc_passes.py for SECONDS, then SIGTERM; OUT.json: its
# cycle collector's passes per generation and every full pass (time since start, ms, the stack).
here=$(cd "$(dirname "$0")" && pwd); data="$here/../../../tests/data/lord-arthur-savile"
work=$(mktemp -d); trap 'kill $pid 2>/dev/null; rm -rf "$work"' EXIT
cd "$work"
export OMP_NUM_THREADS=1 GC_LOG=$(realpath -m "$3") BT_GC_FREEZE_PROBE=$1
python "$here/gc_passes.py" seed --run-id gc$1 --data "$data" --set objective=paper \
  --set d_model=64 --set n_heads=2 --set layers_per_block=2 --set n_blocks=2 --set seq_len=64 \
  --checkpoint-dir ck --port 0 --device cpu --quiet --http-port 0 > node.log 2>&1 &
pid=$!
sleep "$2"
kill -TERM $pid; wait $pid
cat "$GC_LOG"; echo
