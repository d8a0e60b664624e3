"""Probe (2026-12-06, session 34): a plain hivemind peer that joins block 0's averaging groups and then
sends no tensor part and reduces none (tests/test_utils/hostile_averager.py --silent-identities 0).
Records: silent_averager_before.json (the tree of ed26db8, 12:30-12:32 UTC), silent_averager_after.json (the commit after
59ad326, bans of 15 s, 12:43-12:45 UTC).

Two honest holders of block 0 (n0, nb) and one of block 1, tiny blocks, manual rounds. ROUNDS rounds on
n0 and nb at once without the peer, then ROUNDS with it looking for a group all the while. Per round:
each node's verdict (accepted, reason, group size, completeness, seconds). Run from the repository root:

    OMP_NUM_THREADS=1 python docs/records/s34/silent_averager_probe.py OUT_DIR [ROUNDS]
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from test_utils.configs import TEST_CORPUS  # noqa: E402
from test_utils.reliability import (MANUAL_AVG, TINY, HostileProc, RelSwarm, operator_action,  # noqa: E402
                                    stop_swarm)
from test_utils.wire_procs import stop_all  # noqa: E402


def both(n0, nb) -> dict:
    out = {}

    def one(name, n):
        t0 = time.monotonic()
        v = operator_action(n, "/v1/average")
        st = n.get("/v1/status")["averaging"]
        out[name] = {"accepted": v.get("accepted"), "reason": v.get("reason", v.get("error")),
                     "group": v.get("group_size", st.get("last_group_size")), "completeness": st.get("last_completeness"),
                     "s": round(time.monotonic() - t0, 2)}
    ts = [threading.Thread(target=one, args=a) for a in (("n0", n0), ("nb", nb))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def main() -> None:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    out.mkdir(parents=True, exist_ok=True)
    sw = RelSwarm(out, run_id="silent", overrides=TINY, data=str(TEST_CORPUS),
                  extra_args=["--device", "cpu", *MANUAL_AVG, "--checkpoint-every", "1000000", "--no-rebalance"])
    hostile, rec = None, {"clean": [], "attacked": []}
    try:
        n0 = sw.start_seed(block=0, args=["--max-steps", "20"])
        nb = sw.join(0, ["--max-steps", "20"], name="nb")
        sw.join(1, ["--max-steps", "0"], name="h1").wait_ready()
        nb.wait_ready()
        for _ in range(rounds):
            rec["clean"].append(both(n0, nb))
            print("clean", rec["clean"][-1], flush=True)
        hostile = HostileProc([sw.seed_maddr], "silent", out / "hostile.log", block=0, identities=1, silent_identities=(0,))
        hostile.wait_ready(timeout=300)
        hostile.send("round", identity=0, mode="benign", timeout=40.0 * rounds)
        for _ in range(rounds):
            rec["attacked"].append(both(n0, nb))
            print("attacked", rec["attacked"][-1], flush=True)
        rec["status"] = {name: n.get("/v1/status")["averaging"] for name, n in (("n0", n0), ("nb", nb))}
        for v in rec["status"].values():
            v.pop("history", None)
    finally:
        (out / "silent_averager_probe.json").write_text(json.dumps(rec, indent=1, default=str))
        if hostile is not None:
            stop_all([hostile])
        stop_swarm(sw)


if __name__ == "__main__":
    main()
