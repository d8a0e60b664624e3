#!/usr/bin/env bash
# Does `bt-node swarm --budget 20s` work for a new user, again and again? (issue 14)
#
# Clones the repository fresh, builds a fresh venv the README's way (python -m venv; pip install
# torch==2.13.0; pip install -e .), then runs `bt-node swarm --budget BUDGET` RUNS times in a row
# (one at a time, each in its own session and its own --workdir) and counts the runs that exit 0.
# Prints one line per run and "fresh clone COMMIT: N of RUNS"; logs stay in OUT (default: a temp dir).
# Whatever ends the script (the last run, an error, Ctrl-C, SIGTERM), the running swarm is stopped
# (SIGTERM to its session, SIGKILL after 20 s; its nodes also die with it on their own) and the clone
# and venv are removed (--keep keeps them).
#
# Usage: bench/fresh_clone_swarm.sh [--repo PATH|URL] [--ref REF] [--runs 10] [--budget 20s] [--out DIR] [--keep]
#        (PYTHON=python3.11 picks the interpreter for the venv)
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$here"
ref="$(git -C "$here" rev-parse HEAD)"
runs=10
budget=20s
out=""
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --repo) repo="$2"; shift 2 ;;
        --ref) ref="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

work="$(mktemp -d "${TMPDIR:-/tmp}/bt-fresh-XXXXXX")"
out="${out:-$work/logs}"
mkdir -p "$out"
swarm_pid=""

stop_swarm() {   # the running swarm's session: SIGTERM (a graceful stop), SIGKILL after 20 s
    [ -n "$swarm_pid" ] || return 0
    kill -TERM -- "-$swarm_pid" 2>/dev/null || true
    for _ in $(seq 1 200); do
        kill -0 -- "-$swarm_pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$swarm_pid" 2>/dev/null || true
    swarm_pid=""
}

cleanup() {
    stop_swarm
    if [ "$keep" = 0 ]; then rm -rf "$work/repo" "$work/venv" "$work/swarm"*; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

py="${PYTHON:-python3}"
echo "clone $repo @ $ref into $work/repo"
git clone -q "$repo" "$work/repo"
git -C "$work/repo" checkout -q "$ref"
commit="$(git -C "$work/repo" rev-parse --short HEAD)"
echo "fresh venv ($("$py" --version)): pip install torch==2.13.0, then pip install -e ."
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "torch==2.13.0" >"$out/pip.log" 2>&1
"$work/venv/bin/python" -m pip install -q -e "$work/repo" >>"$out/pip.log" 2>&1

ok=0
cd "$work/repo"   # where a new user runs it
for i in $(seq 1 "$runs"); do
    t0=$(date +%s)
    setsid "$work/venv/bin/bt-node" swarm --budget "$budget" --workdir "$work/swarm$i" --json \
        >"$out/run$i.json" 2>"$out/run$i.log" &
    swarm_pid=$!
    rc=0
    wait "$swarm_pid" || rc=$?
    swarm_pid=""
    left=$(pgrep -f -- "$work/swarm$i" || true)   # anything of this run still running is a failure too
    if [ "$rc" = 0 ] && [ -z "$left" ]; then
        ok=$((ok + 1))
        what=$("$work/venv/bin/python" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(f"chain CE {r[\"chain_ce_start\"]:.3f} -> {r[\"chain_ce\"]:.3f}, data {r[\"data\"]}")' "$out/run$i.json" 2>/dev/null || echo "?")
        echo "run $i/$runs: ok in $(( $(date +%s) - t0 )) s ($what)"
    else
        echo "run $i/$runs: FAILED (exit $rc${left:+, processes left: $left}) in $(( $(date +%s) - t0 )) s; last lines:"
        tail -n 5 "$out/run$i.log" | sed 's/^/    /'
        if [ -n "$left" ]; then kill -KILL $left 2>/dev/null || true; fi
    fi
    rm -rf "$work/swarm$i"
done
echo "fresh clone $commit: $ok of $runs (logs: $out)"
