"""Summarise s23.sh's records: per arm, micro-batches completed / lost (by reason), steps per worker,
block 0's budget, stages' expired forwards. Usage: python sum23.py /work/tools/s23_B1.json ..."""
import json
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    r = d["runs"]["pipeline"]
    ws = r["workers"]
    b0 = [w for w in ws if w["block"] == 0][0]
    print(path.rsplit("/", 1)[-1], f"completed {r['microbatches_completed']} lost {r['microbatches_lost']}",
          f"by reason {b0.get('lost_by_reason')}", f"steps per worker {[w['steps'] for w in ws]}",
          f"stalled {r['stalled_s_total']:.0f} s", f"budget {b0.get('budget')}",
          f"expired {[w.get('expired_in_queue') for w in ws]}", f"chain CE (16 windows) {r.get('chain_ce'):.3f}")
