"""Per-process CPU accounting of a CI run (session 35): copy to the CI venv as sitecustomize.py and set
BT_PROC_ACCT=DIR; every Python process writes DIR/PID.json (argv, CPU seconds) each second and at exit.
Then: python docs/records/s35/proc_acct_report.py DIR. Used for BENCHMARKS "Suite time", session 35."""
import os
_d = os.environ.get("BT_PROC_ACCT")
if _d:
    import json, sys, threading, time
    _pid = os.getpid(); _t0 = time.time()
    def _bt_acct_write():
        t = os.times()
        try:
            p = f"{_d}/{_pid}.json"
            with open(p + ".tmp", "w") as f:
                json.dump({"pid": _pid, "ppid": os.getppid(), "argv": list(getattr(sys, "orig_argv", sys.argv))[:8],
                           "t0": _t0, "t1": time.time(), "cpu": t.user + t.system,
                           "mods": len(sys.modules), "torch": "torch" in sys.modules}, f)
            os.replace(p + ".tmp", p)
        except Exception:
            pass
    def _bt_acct_loop():
        while os.getpid() == _pid:
            time.sleep(1.0); _bt_acct_write()
    threading.Thread(target=_bt_acct_loop, daemon=True, name="bt-acct").start()
    import atexit; atexit.register(_bt_acct_write)
