"""Rebalancing a chain-trained (``pipeline``) run in real nodes: in a 2-block run where three nodes
hold block 0 and one holds block 1, one node of block 0 moves to block 1 (download without a loss to
judge by, announce, withdraw), its train loop leaves block 0's pipeline engine for block 1's, and
the chain keeps training through it: the mover receives micro-batches as block 1 and steps, block
0's holders keep completing micro-batches, and generations through the network keep succeeding.
Nobody moves again once the blocks are 2 and 2.

Every move here is the urgent rule's (block 1 has one ready holder; the movers' dwell is 600 s);
tests/test_rebalance_network.py covers the refusals (NaN state, back-off) on the same move code.
"""
from __future__ import annotations

import threading
import time

import pytest

from blocktrain.node.client import NetworkClient

from test_rebalance_network import (MOVERS, PINNED, TTL, _generate_until, _status, assert_one_move_to_two_and_two,
                                    settled)
from test_utils.configs import TEST_CORPUS
from test_utils.reliability import MANUAL_AVG, QUIET_TRAINING, TINY, RelSwarm, report, stop_swarm, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]

RUN = "rebalpipe"


def _pipe(n) -> dict:
    return _status(n)["self"]["pipeline"]


def test_a_pipeline_node_moves_to_the_needier_block_and_the_chain_trains_through_it(tmp_path):
    sw = RelSwarm(tmp_path, run_id=RUN, overrides=["objective=pipeline", *TINY], data=str(TEST_CORPUS),
                  extra_args=["--device", "cpu", *TTL, *MANUAL_AVG, *QUIET_TRAINING])
    client, gen_stop, gen = None, threading.Event(), None
    results: list = []
    try:
        sw.start_seed(block=0, args=MOVERS)
        last = sw.join(1, PINNED, name="last", wait=True)
        movers = [sw.nodes[0], sw.join(0, MOVERS, name="j1"), sw.join(0, MOVERS, name="j2")]
        for n in movers:
            n.wait_ready()
        client = NetworkClient([sw.seed_maddr], RUN)
        gen = threading.Thread(target=_generate_until, args=(client, gen_stop, results), daemon=True)
        gen.start()

        t0 = time.monotonic()
        moved = wait_for(lambda: [n for n in movers if _status(n)["self"]["block"] == 1], 300, "a move to block 1")[0]
        took = time.monotonic() - t0
        stayed = [n for n in movers if n is not moved]
        st = _status(moved)["self"]
        assert st["rebalance"]["moves"][-1]["from"] == 0 and st["rebalance"]["moves"][-1]["to"] == 1
        assert st["state"] == "online" and st["downloaded_state"]
        assert st["pipeline"]["block"] == 1 and st["pipeline"]["last"] is True, st["pipeline"]

        # the chain trains through the mover's new engine: it receives block 1's work and steps, and block
        # 0's remaining holders keep completing micro-batches
        p1, p0 = _pipe(moved), [_pipe(n) for n in stayed]
        wait_for(lambda: _pipe(moved)["received"] > p1["received"] + 3 and _pipe(moved)["steps"] > p1["steps"],
                 120, "micro-batches trained by the mover as block 1")
        wait_for(lambda: sum(_pipe(n)["completed"] for n in stayed) > sum(p["completed"] for p in p0) + 3,
                 120, "micro-batches completed by block 0's holders after the move")

        # balanced 2/2: nobody moves any more; the announcements say so (one more check period: the rule's
        # hysteresis is the same code as tests/test_rebalance_network.py's, which watches three)
        time.sleep(6)
        blocks, moves, live = settled(movers, client)
        gen_stop.set()
        gen.join(timeout=60)
        ok = sum(1 for _, good, _ in results if good)
        report("rebalance_pipeline_move", move_s=round(took, 1), move_took_s=st["rebalance"]["moves"][-1]["took_s"],
               moves=moves, blocks=blocks, generations=len(results), generations_ok=ok,
               mover_received=_pipe(moved)["received"], mover_steps=_pipe(moved)["steps"])
        assert_one_move_to_two_and_two(blocks, moves, live)
        assert all(n.alive for n in [*movers, last])
        errors = [e for e in _status(moved)["errors"] if "pipeline" in e or "abandoned" in e]
        assert not errors, errors   # the old engine and its service stopped cleanly
        assert results and ok == len(results), [r for r in results if not r[1]][:5]
    finally:
        gen_stop.set()
        if gen is not None:
            gen.join(timeout=60)
        if client is not None:
            client.close()
        stop_swarm(sw)
