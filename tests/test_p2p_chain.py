"""Chain planning over a holder map: one holder per block, ranked alternates, clear missing-block errors."""
from __future__ import annotations

import pytest

from blocktrain.p2p.chain import MissingBlockError, plan_chain
from blocktrain.p2p.records import BlockAnnouncement


def ann(peer: str, block: int, **kw) -> BlockAnnouncement:
    base = dict(peer_id=peer, block_index=block, state="online", step=0, samples_seen=0, throughput=1.0, load=0.5,
                serving=True, addresses=[], software_version="t", config_hash="0123456789abcdef", run_id="r")
    return BlockAnnouncement(**{**base, **kw})


HOLDERS = {
    0: [ann("a", 0, load=0.9), ann("b", 0, load=0.1), ann("c", 0, load=0.1, throughput=5.0)],
    1: [ann("d", 1), ann("e", 1, serving=False), ann("f", 1, state="joining")],
}


def test_one_primary_per_block_ranked_by_load_then_throughput():
    plan = plan_chain("r", HOLDERS, 2)
    assert plan.primary_peers == ["c", "d"]
    assert [x.peer_id for x in plan.hops[0].alternates] == ["b", "a"]
    assert plan.hops[1].alternates == ()  # not serving / joining holders are never chosen
    assert [x.peer_id for x in plan.hops[0].candidates] == ["c", "b", "a"]


def test_measured_rtt_dominates_and_custom_rank_key():
    plan = plan_chain("r", HOLDERS, 2, rtt_s={"a": 0.01, "b": 0.5, "c": 0.2})
    assert plan.primary_peers[0] == "a"
    plan = plan_chain("r", HOLDERS, 2, rank_key=lambda x: -x.load)
    assert plan.primary_peers[0] == "a"


def test_exclude_and_missing_blocks():
    assert plan_chain("r", HOLDERS, 2, exclude={"c", "b"}).primary_peers == ["a", "d"]
    with pytest.raises(MissingBlockError, match=r"^block 2 has no live holder$"):
        plan_chain("r", HOLDERS, 3)
    with pytest.raises(MissingBlockError, match=r"block 1 has no live holder \(3 holder\(s\) known"):
        plan_chain("r", HOLDERS, 2, exclude={"d"})
    with pytest.raises(MissingBlockError, match="block 0 has no live holder"):
        plan_chain("r", {}, 1)
    with pytest.raises(ValueError, match="n_blocks"):
        plan_chain("r", HOLDERS, 0)
