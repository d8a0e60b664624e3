"""A downloaded block state is judged before a node trains it (``node/state_fetch.py``).

Every check before (finite, the block's shapes, the run's config) passes a well-formed *worthless* state:
an untrained block offered by a Sybil holder (RELIABILITY.md stated the gap on 2026-12-05: the joiner
adopted it). ``StateFetcher.fetch_best`` downloads from up to ``sources`` holders and keeps the state its
judge scores best: a block-local block by its own held-out check loss (``LossJudge``), a chain-trained
one by the chain's held-out CE with it in place (``ChainJudge``); both refuse a state worse than the
node's own fresh block by the averaging margin. One process, no network: the holders' block RPC is a
dict (the live attack: tests/test_security_state_offers.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from blocktrain.blocks.chain_train import chain_step
from blocktrain.blocks.objectives import get_objective
from blocktrain.node.state_fetch import ChainJudge, LossJudge, StateFetcher
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import TEST_CORPUS, tiny_config

TRAIN = np.frombuffer((TEST_CORPUS / "train.txt").read_bytes()[:200_000], dtype=np.uint8)
HELD_OUT = np.frombuffer((TEST_CORPUS / "test.txt").read_bytes()[:50_000], dtype=np.uint8)
MARGIN = 0.5   # the averaging acceptance policy's max_loss_increase, nats


class _States:
    """Each holder's block RPC: (meta, state dict), in the order the test measured them (asked first)."""

    def __init__(self, states: dict):
        self.states, self.asked = states, []

    def get_block_state_sync(self, peer, b, timeout=None):
        self.asked.append(peer)
        meta, tensors = self.states[peer]
        return dict(meta), {k: v.clone() for k, v in tensors.items()}


def _holders(fetcher: StateFetcher, peers: list[str]) -> list:
    for i, p in enumerate(peers):   # measured before, fastest first: the order the fetcher asks them in
        fetcher.ranking.record_success(p, 0.01 * (i + 1))
    return [SimpleNamespace(peer_id=p, state="online", is_live=True, step=0) for p in peers]


def _meta(cfg, step: int) -> dict:
    return {"config_hash": cfg.config_hash, "step": step, "samples_seen": 4 * step}


def test_a_block_local_download_keeps_the_best_check_loss_not_the_first_offer():
    cfg = tiny_config(objective="paper", n_blocks=2)
    honest = BlockTrainer(cfg, 0, TRAIN, HELD_OUT, seed=1)
    for _ in range(60):
        honest.train_step()
    untrained = BlockTrainer(cfg, 0, TRAIN, HELD_OUT, seed=7).module.state_dict()   # another init, well-formed
    damaged = {k: v * 30 for k, v in honest.module.state_dict().items()}            # finite, right shapes
    client = _States({"sybil": (_meta(cfg, 10 ** 9), untrained), "damaged": (_meta(cfg, 10 ** 9), damaged),
                      "honest": (_meta(cfg, 60), honest.module.state_dict())})
    joiner = BlockTrainer(cfg, 0, TRAIN, HELD_OUT, seed=0)
    judge = LossJudge(joiner, MARGIN)
    fetcher = StateFetcher(client, joiner.objective, self_peer="me", config_hash=cfg.config_hash)
    holders = _holders(fetcher, ["sybil", "damaged", "honest"])

    errors: list[str] = []
    got = fetcher.fetch_best(0, holders, judge, sources=2, errors=errors)
    assert got is not None and got.peer == "honest", got and got.compared
    scores = {c["peer"]: c.get("score") for c in got.compared}
    assert sorted(client.asked[:2]) == ["damaged", "sybil"] and client.asked[2:] == ["honest"]   # 2 at once, then 1
    assert scores["honest"] < scores["sybil"] < judge.fresh + MARGIN, (scores, judge.fresh)
    assert "refused" in got.compared[1] and "check loss" in got.compared[1]["refused"]
    assert any("from damaged refused" in e for e in errors), errors
    rec = fetcher.ranking.known("damaged")   # a refused offer counts as its holder's failure (ranked lower next time)
    assert rec.failures == 1 and "refused state" in rec.last_failure
    assert fetcher.ranking.known("sybil").failures == 0   # a state that only scored worse is no failure

    # one source: the first acceptable offer, whatever it is worth (what a late join did before)
    first = StateFetcher(client, joiner.objective, self_peer="me", config_hash=cfg.config_hash)
    assert first.fetch_best(0, _holders(first, ["sybil", "honest"]), judge, sources=1).peer == "sybil"
    # nothing acceptable: None, and the reasons
    errors = []
    only_bad = StateFetcher(client, joiner.objective, self_peer="me", config_hash=cfg.config_hash)
    assert only_bad.fetch_best(0, _holders(only_bad, ["damaged"]), judge, errors=errors) is None
    assert errors and "check loss" in errors[0]


def test_a_chain_trained_download_is_judged_by_the_chain_with_it_in_place():
    cfg = tiny_config(objective="pipeline", n_blocks=2)
    objective = get_objective(cfg)
    torch.manual_seed(0)
    blocks = [objective.build_block(b) for b in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in blocks]
    g = np.random.default_rng(0)
    for step in range(60):   # the honest chain, trained end to end in one process
        starts = g.integers(0, len(TRAIN) - cfg.seq_len - 1, size=8)
        windows = torch.from_numpy(np.stack([TRAIN[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
        chain_step(objective, blocks, opts, cfg, step, windows, lr=3e-3)
    joiner = BlockTrainer(cfg, 1, TRAIN, HELD_OUT, seed=0)   # a late joiner of block 1: fresh, no loss alone
    assert not joiner.judges_by_loss
    block0 = objective.make_hop(blocks[0].eval(), 0)

    def chain_ce(hop) -> float:   # block 0 from "the network" (here in process), block 1 the offered state
        return objective.score([block0, hop], joiner.check_windows).ce

    judge = ChainJudge(objective, 1, chain_ce, joiner.module, MARGIN)
    untrained = objective.build_block(1).state_dict()
    honest = blocks[1].state_dict()
    exploding = {k: v * 50 for k, v in honest.items()}
    client = _States({"sybil": (_meta(cfg, 10 ** 9), untrained), "exploding": (_meta(cfg, 10 ** 9), exploding),
                      "other-run": ({**_meta(cfg, 60), "config_hash": "0" * 16}, honest),
                      "honest": (_meta(cfg, 60), honest)})
    fetcher = StateFetcher(client, objective, self_peer="me", config_hash=cfg.config_hash)
    errors: list[str] = []
    got = fetcher.fetch_best(1, _holders(fetcher, ["sybil", "exploding", "other-run", "honest"]), judge,
                             sources=2, errors=errors)
    assert got is not None and got.peer == "honest", got and got.compared
    scores = {c["peer"]: c.get("score") for c in got.compared}
    assert scores["honest"] < scores["sybil"] - 0.1, scores    # the trained block makes the chain better
    refused = {c["peer"]: c["refused"] for c in got.compared if "refused" in c}
    assert "exploding" in refused and "chain" in refused["exploding"], got.compared
    assert any("other-run" in e and "config hash" in e for e in errors), errors   # refused at the download

    # the chain cannot be run (a block without a reachable holder): not judged, the first acceptable is kept
    def unreachable(hop) -> float:
        raise RuntimeError("no live holder of block 0")

    blind = ChainJudge(objective, 1, unreachable, joiner.module, MARGIN)
    assert blind.fresh is None
    f2 = StateFetcher(client, objective, self_peer="me", config_hash=cfg.config_hash)
    got = f2.fetch_best(1, _holders(f2, ["sybil", "honest"]), blind, sources=2)
    assert got.peer == "sybil" and [c["score"] for c in got.compared] == [None, None]


def test_sources_must_be_at_least_one():
    fetcher = StateFetcher(_States({}), None, self_peer="me")
    with pytest.raises(ValueError, match="sources"):
        fetcher.fetch_best(0, [], lambda m: 0.0, sources=0)


def test_the_states_still_wanted_are_downloaded_at_once():
    """Two sources wanted, two holders: both downloads run together (a holder's uplink, not the downloader's
    link, usually limits a transfer), then both are judged. Each fake download waits for the other to start:
    one after the other, the first would give up waiting and fail."""
    import threading

    cfg = tiny_config(objective="paper", n_blocks=2)
    joiner = BlockTrainer(cfg, 0, TRAIN, HELD_OUT, seed=0)
    both = threading.Barrier(2, timeout=10)
    state = joiner.module.state_dict()

    class Together(_States):
        def get_block_state_sync(self, peer, b, timeout=None):
            both.wait()
            return super().get_block_state_sync(peer, b, timeout)

    client = Together({"a": (_meta(cfg, 5), state), "b": (_meta(cfg, 5), state)})
    fetcher = StateFetcher(client, joiner.objective, self_peer="me", config_hash=cfg.config_hash)
    errors: list[str] = []
    got = fetcher.fetch_best(0, _holders(fetcher, ["a", "b"]), LossJudge(joiner, MARGIN), sources=2, errors=errors)
    assert got is not None and len(got.compared) == 2 and not errors, (got, errors)


def test_a_state_that_breaks_the_judge_is_refused_not_raised():
    """Whatever a state does to the judge (here it raises), the download goes on to the next holder: a
    hostile offer must not stop a late join."""
    cfg = tiny_config(objective="paper", n_blocks=2)
    joiner = BlockTrainer(cfg, 0, TRAIN, HELD_OUT, seed=0)
    state = joiner.module.state_dict()
    client = _States({"odd": (_meta(cfg, 5), state), "fine": (_meta(cfg, 5), state)})
    fetcher = StateFetcher(client, joiner.objective, self_peer="me", config_hash=cfg.config_hash)
    calls = []

    def judge(module):
        calls.append(module)
        if len(calls) == 1:
            raise RuntimeError("the check loss could not be computed")
        return 1.0

    got = fetcher.fetch_best(0, _holders(fetcher, ["odd", "fine"]), judge, sources=1)
    assert got is not None and got.score == 1.0
    assert "refused" in got.compared[0] and "could not be computed" in got.compared[0]["refused"]
