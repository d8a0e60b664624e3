#!/usr/bin/env bash
# session 22: s22r.sh's arm N again with --average-clock 30 (block 1's two replicas meet on the clock):
# a replicated d768 pipeline worker's peak with averaging rounds during training. Under the heavy lock.
# (Run at ca9cbbb as a copy of s22r.sh's loop; folded into s22r.sh since, same command.)
exec "$(dirname "$0")/s22r.sh" C --average-clock 30
