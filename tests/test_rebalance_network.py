"""Rebalancing in real nodes: in a 2-block run where three nodes hold block 0 and one holds block 1,
one node of block 0 moves to block 1 (download, announce, withdraw) within a bounded time, while
generations through the network keep succeeding; a holder of block 1 that offers NaN state makes
every move refused (the movers stay on block 0, alive, and do not retry every period); nobody flaps
once the blocks are 2 and 2.

The movers' dwell is the default 600 s, longer than the test: every move here is the urgent rule's
(block 1 has one ready holder), the ordinary rule's hysteresis is never met (selection unit tests
and the simulator cover it; the node's move itself is the same code either way).
"""
from __future__ import annotations

import threading
import time

import pytest

from blocktrain.node.client import NetworkClient

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import MANUAL_AVG, QUIET_TRAINING, TINY, RelSwarm, report, stop_swarm, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]

RUN = "rebal"
TTL = ["--announce-ttl", "15"]               # every node: announcements refreshed and rebalancing checked every 5 s
MOVERS = ["--rebalance-dwell", "600"]        # only urgent moves within the test
PINNED = ["--no-rebalance"]


def _status(n) -> dict:
    return n.get("/v1/status")


def _generate_until(client, stop: threading.Event, results: list) -> None:
    while not stop.is_set():
        try:
            out = client.generate(b"The ", 8)
            results.append((time.time(), True, out["route"] if "route" in out else None))
        except Exception as e:
            results.append((time.time(), False, f"{type(e).__name__}: {e}"))
        stop.wait(1.0)


def settled(movers, client) -> tuple[list[int], list[int], dict[int, list[str]]]:
    """After the moves: each mover's block and number of moves, and the live holders of blocks 0 and 1
    as the DHT announces them."""
    blocks = [_status(n)["self"]["block"] for n in movers]
    moves = [len(_status(n)["self"]["rebalance"]["moves"]) for n in movers]
    holders = client.holders()
    return blocks, moves, {b: sorted(a.peer_id for a in holders.get(b, []) if a.is_live) for b in (0, 1)}


def assert_one_move_to_two_and_two(blocks, moves, live) -> None:
    assert sorted(blocks) == [0, 0, 1], blocks
    assert sum(moves) == 1, moves
    assert len(live[0]) == 2 and len(live[1]) == 2, live


def test_surplus_node_moves_to_needier_block_and_bad_state_is_refused(tmp_path):
    sw = RelSwarm(tmp_path, run_id=RUN, overrides=TINY, data=str(TEST_CORPUS),
                  extra_args=["--device", "cpu", *TTL, *MANUAL_AVG, *QUIET_TRAINING])
    client, gen_stop, gen = None, threading.Event(), None
    results: list = []
    try:
        sw.start_seed(block=0, args=MOVERS)
        bad = sw.join(1, PINNED, name="bad", fault="nan_state", wait=True)   # block 1's only holder: NaN state
        movers = [sw.nodes[0], sw.join(0, MOVERS, name="j1"), sw.join(0, MOVERS, name="j2")]
        for n in movers:
            n.wait_ready()
        client = NetworkClient([sw.seed_maddr], RUN)

        # 1. every move to block 1 is refused: its only holder offers NaN state
        def refused():
            return [r for n in movers for r in _status(n)["self"]["rebalance"]["refused"]]
        got = wait_for(refused, 240, "a refused move")
        time.sleep(16)      # without a back-off each mover would retry at every 5 s check
        got = refused()
        for n in movers:
            at = sorted(r["at"] for r in _status(n)["self"]["rebalance"]["refused"])
            gaps = [b - a for a, b in zip(at, at[1:])]
            assert all(g >= 20 for g in gaps), gaps   # RETRY_PERIODS (6) x 5 s, less the move's own time
        assert all(n.alive for n in [*movers, bad])
        assert [_status(n)["self"]["block"] for n in movers] == [0, 0, 0]
        errors = [e for n in movers for e in _status(n)["errors"]]
        assert any("not finite" in e for e in errors), errors
        assert client.generate(b"The ", 8)["text"] is not None   # hops of block 1 are still honest

        # 2. an honest holder replaces it: one node of block 0 moves, generations keep succeeding
        bad.stop(timeout=30)
        sw.join(1, PINNED, name="good", wait=True)
        gen = threading.Thread(target=_generate_until, args=(client, gen_stop, results), daemon=True)
        gen.start()
        t0 = time.monotonic()
        moved = wait_for(lambda: [n for n in movers if _status(n)["self"]["block"] == 1], 300, "a move to block 1")
        took = time.monotonic() - t0
        st = _status(moved[0])["self"]
        assert st["rebalance"]["moves"][-1]["from"] == 0 and st["rebalance"]["moves"][-1]["to"] == 1
        assert st["state"] == "online" and st["downloaded_state"]

        # 3. balanced 2/2: nobody moves any more (hysteresis), the announcements say so
        time.sleep(18)      # 3 checks and more
        blocks, moves, live = settled(movers, client)
        gen_stop.set()
        gen.join(timeout=60)
        ok = sum(1 for _, good, _ in results if good)
        report("rebalance_move", move_s=round(took, 1), move_took_s=st["rebalance"]["moves"][-1]["took_s"],
               moves=moves, blocks=blocks, generations=len(results),
               generations_ok=ok, refused=len(got))
        assert_one_move_to_two_and_two(blocks, moves, live)
        assert results and ok == len(results), [r for r in results if not r[1]][:5]
    finally:
        gen_stop.set()
        if gen is not None:
            gen.join(timeout=60)
        if client is not None:
            client.close()
        stop_swarm(sw)
