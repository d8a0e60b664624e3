"""Who a late joiner downloads its block's state from. hivemind's averager offers its state to
downloaders as soon as it starts and breaks ties among offers (all of priority 0) at random, so a
node still downloading (a fresh init) could hand that init to a concurrent joiner, which adopted it
as "the block's state". Now an averager offers nothing until the node says its state is worth having
(``share_state``: online, or a move's checked download), with its step as the priority: a
downloader gets the most trained holder's state, never a joiner's init.

Real hivemind DHTs and averagers on 127.0.0.1 in one process, read back from the DHT's own
``{prefix}.all_averagers`` record (what hivemind's ``load_state_from_peers`` reads)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from blocktrain.node.averaging.rounds import BlockAverager
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

pytestmark = [pytest.mark.network]

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)
RUN = "share"


def _offers(disc, prefix: str) -> dict[str, float | None]:
    """The state offers hivemind's downloaders see: peer -> priority (None: offer withdrawn)."""
    from hivemind.p2p import PeerID   # the test reads hivemind's own record, as an outsider would

    rec, _ = disc.dht.get(f"{prefix}.all_averagers", latest=True) or ({}, None)
    return {str(PeerID(k)): getattr(v, "value", None) for k, v in (rec or {}).items()}


def test_a_downloader_gets_the_most_trained_holder_never_a_joiners_init():
    from blocktrain.p2p.discovery import Discovery

    first = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=[RUN])
    discs, avgs = [first], []
    peers = [str(a) for a in first.dht.get_visible_maddrs()]
    try:
        for _ in range(3):
            discs.append(Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=[RUN], initial_peers=peers))
        trainers = [BlockTrainer(tiny_config(), 0, DATA, DATA) for _ in discs]
        avgs = [BlockAverager(d.dht, t, RUN, peer_id=d.peer_id, matchmaking_time=1.0)
                for d, t in zip(discs, trainers)]
        holder, less_trained, joiner, downloader = avgs
        prefix = holder.prefix
        for _ in range(40):
            trainers[0].train_step()
        for _ in range(7):
            trainers[1].train_step()
        trained = trainers[0].parameters_snapshot()
        holder.share_state()
        less_trained.share_state()        # the joiner (fresh init, step 0) and the downloader offer nothing

        want = {discs[0].peer_id: 40.0, discs[1].peer_id: 7.0}
        deadline = time.monotonic() + 30
        while True:
            seen = {p: v for p, v in _offers(discs[3], prefix).items() if v is not None}
            if seen == want or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert seen == want, seen     # before: every averager offered its state at priority 0.0
        assert discs[2].peer_id not in seen and discs[3].peer_id not in seen

        meta = downloader.download_state(timeout=30)
        assert meta is not None and meta["step"] == 40, meta      # the highest priority answers first
        assert trainers[3].step == 40
        got = trainers[3].parameters_snapshot()
        assert all(np.allclose(a.numpy(), b.numpy()) for a, b in zip(got, trained))

        holder.handle.share_state(None)   # withdrawn: the next downloader gets the other holder
        deadline = time.monotonic() + 30
        while _offers(discs[3], prefix).get(discs[0].peer_id) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _offers(discs[3], prefix).get(discs[0].peer_id) is None
        assert joiner.download_state(timeout=30)["step"] == 7
    finally:
        for a in avgs:
            a.shutdown()
        for d in discs:
            d.shutdown(withdraw=False)
