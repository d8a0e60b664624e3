"""The router looks a block up again for a few seconds when nobody is seen to hold it yet (a holder
that just restarted is stored in the DHT, but not yet seen by every reader), then fails clearly."""
from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

import pytest
import torch

from blocktrain.blocks.chain import HopRequest, HopResult
from blocktrain.node.routing import router as router_mod
from blocktrain.node.routing.router import RouteLog, Router


def _ann(peer):
    return SimpleNamespace(peer_id=peer, state="online", serving=True)


class Discovery:
    """Holder P1 of block 1 appears after ``hidden_reads`` reads (None: never); ``gone`` is seen until then."""

    def __init__(self, hidden_reads: int | None, gone: str | None = None):
        self.hidden_reads, self.gone, self.reads = hidden_reads, gone, 0

    def list_holders(self, run_id):
        self.reads += 1
        if self.hidden_reads is None or self.reads <= self.hidden_reads:
            return {1: [_ann(self.gone)]} if self.gone else {}
        return {1: [_ann("P1")]}


@pytest.fixture
def answered(monkeypatch):
    """Every remote hop answers at once with its input (the hop's transport is not what is tested)."""
    calls = []

    def start_remote(client, peer, b, req, timeout):
        calls.append(peer)
        f = concurrent.futures.Future()
        if peer == "GONE":   # a holder that just left
            f.set_exception(OSError("peer unreachable"))
        else:
            f.set_result((HopResult(req.state, None), 0, 0))
        return f
    monkeypatch.setattr(router_mod, "start_remote", start_remote)
    return calls


def _hop(disc, grace: float):
    r = Router(disc, client=None, run_id="r", n_blocks=2, hop_timeout=20.0, discovery_grace_s=grace, holders_ttl=0.0)
    return r.hops(RouteLog())[1]


def _req():
    return HopRequest(state=torch.zeros(1, 2, 4), context=torch.zeros(1, 2, dtype=torch.long),
                      sigma=torch.ones(1), sigma_next=torch.zeros(1))


def test_a_holder_seen_late_is_used_within_the_grace(answered):
    disc = Discovery(hidden_reads=3)
    t0 = time.monotonic()
    _hop(disc, grace=5.0)(_req())
    assert answered == ["P1"] and disc.reads >= 4
    assert time.monotonic() - t0 < 5.0


def test_without_grace_the_first_empty_reads_fail_the_hop(answered):
    with pytest.raises(router_mod.NoLiveHolderError, match="block 1 has no live holder"):
        _hop(Discovery(hidden_reads=3), grace=0.0)(_req())
    assert answered == []


def test_a_block_nobody_holds_fails_clearly_after_the_grace(answered):
    disc = Discovery(hidden_reads=None)
    t0 = time.monotonic()
    with pytest.raises(router_mod.NoLiveHolderError, match="block 1 has no live holder"):
        _hop(disc, grace=2.0)(_req())
    assert 1.5 <= time.monotonic() - t0 < 10.0 and disc.reads >= 2


def test_a_replacement_of_a_holder_that_left_is_used_within_the_grace(answered):
    disc = Discovery(hidden_reads=3, gone="GONE")
    _hop(disc, grace=5.0)(_req())
    assert answered == ["GONE", "P1"]
