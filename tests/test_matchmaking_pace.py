"""What one averaging round costs the DHT. hivemind 1.1.12's matchmaking re-read the group key's
averagers as fast as the DHT answered while it had no leader to ask (a lone replica, or the peer that
leads), and it re-declared this peer's state offer once per averaged tensor: six tiny nodes spent about half
of their CPU on it (BENCHMARKS.md "Matchmaking's DHT reads"). ``p2p/averager.py`` paces the search
(``pace_matchmaking``: one read per ``MATCHMAKING_FETCH_INTERVAL_S``), and hivemind's state sharing is off
(a block's state travels over the block RPC, ``node/state_fetch.py``): a round stores no offer at all. Real hivemind DHTs and averagers on 127.0.0.1, in this process; hivemind's own methods are
counted as they are called."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from blocktrain.node.averaging.rounds import BlockAverager
from blocktrain.node.trainer import BlockTrainer
from blocktrain.p2p.averager import MATCHMAKING_FETCH_INTERVAL_S

from test_utils.configs import tiny_config

pytestmark = [pytest.mark.network]

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)
RUN = "pace"
WINDOW_S = 2.0


@pytest.fixture
def counted(monkeypatch):
    """Calls of hivemind's group-key read and of DHT stores of state offers, as they happen."""
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.dht import DHT

    counts = {"reads": 0, "offers": 0}
    read, store = GroupKeyManager.get_averagers, DHT.store

    async def get_averagers(self, *a, **k):
        counts["reads"] += 1
        return await read(self, *a, **k)

    def dht_store(self, key, *a, **k):
        if str(key).endswith(".all_averagers"):
            counts["offers"] += 1
        return store(self, key, *a, **k)

    monkeypatch.setattr(GroupKeyManager, "get_averagers", get_averagers)
    monkeypatch.setattr(DHT, "store", dht_store)
    return counts


def _reads_allowed(seconds: float) -> float:
    return seconds / MATCHMAKING_FETCH_INTERVAL_S + 3   # one read per interval, and the first at once


def test_a_round_reads_the_group_key_at_a_paced_rate_and_offers_no_state(counted):
    from blocktrain.p2p.discovery import Discovery

    first = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=[RUN])
    discs, avgs = [first], []
    try:
        discs.append(Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=[RUN],
                                     initial_peers=[str(a) for a in first.dht.get_visible_maddrs()]))
        trainers = [BlockTrainer(tiny_config(), 0, DATA, DATA) for _ in discs]
        for t in trainers:
            for _ in range(3):
                t.train_step()
        avgs = [BlockAverager(d.dht, t, RUN, peer_id=d.peer_id, matchmaking_time=WINDOW_S, round_timeout=6.0)
                for d, t in zip(discs, trainers)]
        n_tensors = len(list(trainers[0].module.parameters()))
        assert n_tensors >= 8        # what the per-tensor re-offer would have multiplied
        time.sleep(1.0)
        assert counted["offers"] == 0, counted   # started: no offer (before: one per averager, then per round)

        # a lone replica's round: no group can form; the search reads at the paced rate for its whole window
        counted.update(reads=0, offers=0)
        t0 = time.monotonic()
        assert avgs[0].round() is None or not avgs[0].stats.succeeded
        lone_s = time.monotonic() - t0
        assert counted["reads"] >= 2, counted          # it did search
        assert counted["reads"] <= _reads_allowed(lone_s), (counted, lone_s)   # before: hundreds a second

        # two replicas: the round forms, is accepted by both, and costs each a paced search and no offer
        counted.update(reads=0, offers=0)
        verdicts = [None, None]

        def run(i):
            verdicts[i] = avgs[i].round()

        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        both_s = time.monotonic() - t0
        assert all(v is not None and v.accepted for v in verdicts), verdicts
        assert counted["reads"] <= 2 * _reads_allowed(both_s), (counted, both_s)
        assert counted["offers"] == 0, counted      # before: one store per averaged tensor, per replica
    finally:
        for a in avgs:
            a.handle.shutdown()
        for d in discs:
            d.shutdown(withdraw=False)
