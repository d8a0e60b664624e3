#!/usr/bin/env bash
# What does a node cost its machine? (the training duty cycle and the lone-holder averaging rule)
#
# Starts one `bt-node seed` of a tiny 2-block run on 127.0.0.1 (so it is its block's only holder), with
# the default averaging schedule (--average-every 20, --average-period 10) plus any NODE_ARGS given,
# waits SETTLE seconds after it is ready, then measures SECONDS seconds: the CPU seconds of the node
# process and of its p2pd child (from /proc), the training steps taken, and the averaging rounds it
# attempted and skipped. Prints one line. The node is stopped (SIGINT, then SIGKILL after 20 s) on
# every exit path, Ctrl-C included.
#
# With --peer, a second node joins the run on block 1 (its own block's only holder too) before the
# measurement: the measured node then shares its DHT with another node, as in a real network.
#
# Usage: bench/lone_node_cost.sh [--seconds 60] [--settle 5] [--peer] [--] [NODE_ARGS...]
#   e.g. bench/lone_node_cost.sh -- --max-steps 0        (an idle node)
#        bench/lone_node_cost.sh -- --train-duty 0.25    (a node training a quarter of the time)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
seconds=60; settle=5; peer=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2;;
    --settle) settle="$2"; shift 2;;
    --peer) peer=1; shift;;
    --) shift; break;;
    *) break;;
  esac
done
bt="${BT_NODE:-bt-node}"
work="$(mktemp -d)"
pid=""; ppid_=""
cleanup() {
  for p in $pid $ppid_; do
    if kill -0 "$p" 2>/dev/null; then
      kill -INT "$p" 2>/dev/null || true
      for _ in $(seq 200); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$p" 2>/dev/null || true
    fi
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
sets=()
for x in d_model=32 n_heads=2 layers_per_block=1 n_blocks=2 seq_len=32 target_dim=16 batch_size=4 warmup_steps=0; do
  sets+=(--set "$x")
done
OMP_NUM_THREADS=1 "$bt" seed --run-id lonecost --data "$here/tests/data/lord-arthur-savile" "${sets[@]}" --device cpu \
  --http-port 0 --quiet --ready-file "$work/ready.json" --checkpoint-dir "$work/ckpt" "$@" > "$work/log" 2>&1 &
pid=$!
for _ in $(seq 600); do [ -f "$work/ready.json" ] && break; kill -0 "$pid" 2>/dev/null || { cat "$work/log"; exit 1; }; sleep 0.2; done
[ -f "$work/ready.json" ] || { echo "the node did not start in 120 s" >&2; exit 1; }
port="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['http_port'])" "$work/ready.json")"
if [ "$peer" = 1 ]; then
  maddr="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['maddrs'][0])" "$work/ready.json")"
  OMP_NUM_THREADS=1 "$bt" join --initial-peers "$maddr" --run-id lonecost --data "$here/tests/data/lord-arthur-savile" \
    --block 1 --device cpu --quiet --ready-file "$work/peer.json" --checkpoint-dir "$work/peer" "$@" > "$work/peer.log" 2>&1 &
  ppid_=$!
  for _ in $(seq 600); do [ -f "$work/peer.json" ] && break; kill -0 "$ppid_" 2>/dev/null || { cat "$work/peer.log"; exit 1; }; sleep 0.2; done
fi
cpu() {  # utime+stime (clock ticks) of a pid, and of its children
  local self kids=0
  self=$(awk '{print $14+$15}' "/proc/$1/stat")
  for c in $(pgrep -P "$1"); do kids=$((kids + $(awk '{print $14+$15}' "/proc/$c/stat"))); done
  echo "$self $kids"
}
status() { python3 -c "import json,sys,urllib.request as u; d=json.load(u.urlopen('http://127.0.0.1:$port/v1/status'))
a=d['averaging']; print(d['self']['step'], a['attempted'], a.get('skipped_alone', 'n/a'))"; }
sleep "$settle"
read -r c0 k0 < <(cpu "$pid"); read -r s0 a0 k_0 < <(status)
sleep "$seconds"
read -r c1 k1 < <(cpu "$pid"); read -r s1 a1 k_1 < <(status)
tick=$(getconf CLK_TCK)
python3 - "$c0" "$c1" "$k0" "$k1" "$tick" "$seconds" "$s0" "$s1" "$a0" "$a1" "$k_0" "$k_1" "$*" "$peer" <<'PY'
import sys
c0, c1, k0, k1, tick, secs, s0, s1, a0, a1 = map(float, sys.argv[1:11])
print(f"lone node{' (a peer on block 1)' if sys.argv[14] == '1' else ''} [{sys.argv[13] or 'defaults'}] over {secs:.0f} s: node CPU {(c1 - c0) / tick:.2f} s "
      f"({100 * (c1 - c0) / tick / secs:.0f}% of a core), p2pd CPU {(k1 - k0) / tick:.2f} s, "
      f"steps {s1 - s0:.0f}, rounds attempted {a1 - a0:.0f}, skipped alone {sys.argv[11]} -> {sys.argv[12]}")
PY
