"""The ``forward-residual`` objective (issue 8, candidate d): a later block starts as the identity
on the stream and reads it through block 0's readout, so adding it changes nothing until it has
trained; no gradient reaches block 0; its readout travels with its state and serves its hop."""
from __future__ import annotations

import copy

import pytest
import torch

from blocktrain.blocks.objectives import OBJECTIVES, get_objective
from blocktrain.blocks.objectives.forward_residual import ForwardResidualObjective
from blocktrain.blocks.train import make_optimizer, optimizer_step

from test_utils.configs import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


def fr_config(**kw):
    return tiny_config(objective="forward-residual", **kw)


def text_windows(n=64, t=32):
    data = torch.tensor(list(b"the cat sat on the mat; the dog sat on the log. " * 60))
    return torch.stack([data[s:s + t + 1] for s in range(0, n * 7, 7)])


def train(obj, cfg, m, b, w, steps, up, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = make_optimizer(m, cfg)
    for step in range(steps):
        batch = w[torch.randint(0, len(w), (8,), generator=g)]
        optimizer_step(m, opt, cfg, step, lambda: obj.local_loss(m, b, batch, g, upstream=up))


def test_registered_and_later_blocks_have_no_trainable_head():
    cfg = fr_config()
    obj = get_objective(cfg)
    assert OBJECTIVES["forward-residual"] is ForwardResidualObjective
    assert obj.needs_upstream and obj.ce_kind == "exact" and obj.state_dim() == cfg.d_model
    b0, b1 = obj.build_block(0), obj.build_block(1)
    assert any(n.startswith("head.") for n, _ in b0.named_parameters())
    assert not any("head" in n or "readout" in n for n, _ in b1.named_parameters())
    assert {"readout_weight", "readout_bias"} <= set(b1.state_dict())     # travels with the block


def test_an_untrained_later_block_changes_nothing_and_training_it_helps():
    cfg = fr_config(n_blocks=2, lr=3e-3)
    obj = get_objective(cfg)
    w = text_windows()
    b0, b1 = obj.build_block(0), obj.build_block(1)
    train(obj, cfg, b0, 0, w, 40, [])
    snap0 = copy.deepcopy(b0).eval()
    frozen0 = [p.detach().clone() for p in b0.parameters()]
    # zero steps of block 1 (one loss evaluation adopts the readout): the chain is block 0 exactly
    obj.local_loss(b1, 1, w[:4], upstream=[snap0])
    before = obj.score(obj.local_hops([b0, b1]), w).extra["prefix_ce"]
    assert before[1] == pytest.approx(before[0], abs=1e-5)
    train(obj, cfg, b1, 1, w, 40, [snap0], seed=1)
    after = obj.score(obj.local_hops([b0, b1]), w).extra["prefix_ce"]
    assert after[0] == pytest.approx(before[0], abs=1e-6)            # block 0 untouched
    assert after[1] < before[1] - 0.01, (before, after)
    assert all(torch.equal(p, q) for p, q in zip(b0.parameters(), frozen0))
    # the readout block 1 serves with is block 0's head, carried in block 1's own state
    fresh = obj.build_block(1)
    fresh.load_state_dict(b1.state_dict())
    assert torch.equal(fresh.readout_weight, b0.head.weight)
    assert obj.score(obj.local_hops([b0, fresh]), w).ce == pytest.approx(after[1], abs=1e-6)
