"""A measuring instrument, not product code: with this folder on PYTHONPATH and EXP_COUNT=PREFIX, every
Python process of a node counts its hivemind P2P calls (by handler name) and its DHT gets/stores (by the
calling lines outside the counter), and writes them to PREFIX.<pid> at exit. Used with
docs/records/s30/matchmaking_cpu.py (BENCHMARKS.md "Matchmaking's DHT reads"):

    EXP_COUNT=/tmp/cnt PYTHONPATH=docs/records/s30/count_calls OMP_NUM_THREADS=1 \
        python docs/records/s30/matchmaking_cpu.py --nodes 6 --window 60
"""
import atexit
import collections
import json
import os
import time
import traceback

if os.environ.get("EXP_COUNT"):
    import hivemind.dht.dht as _dht
    import hivemind.p2p.p2p_daemon as _daemon

    _counts = collections.Counter()
    _t0 = time.time()

    def _where(skip=("sitecustom", "threading")):
        st = traceback.extract_stack(limit=40)
        return " < ".join(f"{'/'.join(fr.filename.split('/')[-2:])}:{fr.lineno}" for fr in st
                          if not any(s in fr.filename for s in skip))[-200:]

    def _unary(f):
        async def g(self, peer_id, handle_name, *a, **k):
            _counts[handle_name] += 1
            return await f(self, peer_id, handle_name, *a, **k)
        return g

    def _stream(f):
        def g(self, peer_id, handle_name, *a, **k):
            _counts[handle_name] += 1
            return f(self, peer_id, handle_name, *a, **k)
        return g

    _daemon.P2P.call_protobuf_handler = _unary(_daemon.P2P.call_protobuf_handler)
    _daemon.P2P.iterate_protobuf_handler = _stream(_daemon.P2P.iterate_protobuf_handler)

    def _dht_call(f, name):
        def g(self, *a, **k):
            _counts[f"DHT.{name} <- {_where()}"] += 1
            return f(self, *a, **k)
        return g

    _dht.DHT.get = _dht_call(_dht.DHT.get, "get")
    _dht.DHT.store = _dht_call(_dht.DHT.store, "store")

    @atexit.register
    def _dump():
        with open(os.environ["EXP_COUNT"] + f".{os.getpid()}", "w") as fh:
            fh.write(json.dumps({"s": round(time.time() - _t0, 1), "calls": dict(_counts.most_common())}) + "\n")
