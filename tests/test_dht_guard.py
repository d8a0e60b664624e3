"""What other peers can make a node's DHT keep (``p2p/dht_guard.py``).

hivemind's DHT stores any value any peer sends, under any key, with no bound. Before the guard an
outsider storing 100,000 values of 4 KB straight to a seeded node grew it by 425 MiB in 25 s
(``docs/records/s33/dht_flood_probe.py``). Now a node keeps at most 16 MiB of others' values (4 MiB in
its cache), none over 64 KiB or living past 31 days, at most 4,096 subkeys per key; new records beyond
that are refused, held ones can still be refreshed.

Unit: ``GuardedStorage`` itself. Live: a real ``bt-node seed`` and an outsider's plain hivemind
``DHTNode`` calling the store RPC on it directly.
"""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import SWARM_DEFAULTS
from blocktrain.p2p.dht_guard import ITEM_OVERHEAD, GuardedStorage

from test_utils.configs import TEST_CORPUS


def test_guarded_storage_refuses_big_long_many_and_beyond_its_budget():
    s = GuardedStorage(max_bytes=10 * (1000 + ITEM_OVERHEAD), max_value_bytes=2000, max_subkeys=3, max_ttl_s=100)
    now = get_dht_time()
    k = [DHTID.generate(source=f"k{i}") for i in range(20)]
    assert not s.store(k[0], b"x" * 2001, now + 10) and s.refused["too_big"] == 1
    assert not s.store(k[0], b"x", now + 1000) and s.refused["too_long"] == 1
    for i in range(3):
        assert s.store_subkey(k[1], f"sub{i}", b"v", now + 10)
    assert not s.store_subkey(k[1], "sub3", b"v", now + 10) and s.refused["too_many_subkeys"] == 1
    assert s.store_subkey(k[1], "sub0", b"w", now + 20)   # a held subkey is refreshed
    assert isinstance(s.get(k[1]).value, DictionaryDHTValue)
    stored = sum(s.store(k[i], b"y" * 1000, now + 10) for i in range(2, 20))
    assert stored == 9 and s.refused["full"] == 18 - 9, (stored, s.refused)   # 10 values' worth, 1 of subkeys
    assert s.store(k[2], b"z" * 1000, now + 50)    # full, but a held key may still be refreshed
    assert s.get(k[2]).value == b"z" * 1000


@pytest.mark.network
def test_an_outsider_cannot_fill_a_nodes_memory_through_its_dht(tmp_path):
    sw = LocalSwarm(tmp_path / "net", run_id="flood", overrides=SWARM_DEFAULTS + ["n_blocks=1", "objective=paper"],
                    data=str(TEST_CORPUS))
    try:
        node = sw.start_seed(block=0, args=["--max-steps", "1"])
        node.wait_ready()
        maddr = sw.seed_maddr
        target = PeerID.from_base58(maddr.rsplit("/", 1)[1])

        async def flood():
            out = await DHTNode.create(initial_peers=[maddr], client_mode=True)
            try:
                ok = 0
                for start in range(0, 6000, 500):   # 6,000 x 4 KB = 24 MB, beyond the 16 MiB a node keeps
                    keys = [DHTID.generate(source=f"junk{i}") for i in range(start, start + 500)]
                    res = await out.protocol.call_store(target, keys, [os.urandom(4000) for _ in keys],
                                                        [get_dht_time() + 3600] * len(keys))
                    ok += sum(bool(r) for r in res)
                big = await out.protocol.call_store(target, [DHTID.generate(source="big")], [os.urandom(100_000)],
                                                    [get_dht_time() + 60])
                forever = await out.protocol.call_store(target, [DHTID.generate(source="long")], [b"x"],
                                                        [get_dht_time() + 365 * 86400])
                return ok, big, forever
            finally:
                await out.shutdown()

        ok, big, forever = asyncio.run(flood())
        assert 3000 < ok < 4400, ok          # about 16 MiB of 4 KB values (with the per-value overhead)
        assert big == [False] and forever == [False]
        metrics = httpx.get(node.url + "/metrics", timeout=30).text
        refused = [ln for ln in metrics.splitlines() if ln.startswith("blocktrain_dht_records_refused_total")]
        assert refused and float(refused[0].split()[-1]) == 6000 - ok + 2, refused
        # the node still serves and its own records are still found
        st = node.get("/v1/status")
        assert [h["is_self"] for h in st["blocks"][0]["holders"]] == [True], st["blocks"]
        r = httpx.post(node.url + "/v1/generate", json={"prompt": "The ", "max_bytes": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        sw.stop_all()
