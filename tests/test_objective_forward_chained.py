"""The ``forward-chained`` objective (issue 8, candidate c): block b trains on detached outputs of
blocks < b; no gradient crosses blocks; the chain is the stack with an exact CE; FLOP accounting
charges the upstream forwards; snapshots go stale between refreshes as configured."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from blocktrain.blocks.chain import CountingHop
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.objectives import OBJECTIVES, get_objective
from blocktrain.blocks.objectives.forward_chained import ForwardChainedObjective
from blocktrain.blocks.train import make_optimizer, optimizer_step
from blocktrain.blocks.local_run import LocalRun

from test_utils import flop_formulas
from test_utils.configs import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


def fc_config(**kw):
    return tiny_config(objective="forward-chained", **kw)


def windows(n, t, seed=0):
    return torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(seed))


def text_split():
    data = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)
    return DataSplit(data, data, "test", "in-memory")


def test_registered_with_hidden_state_and_upstream():
    cfg = fc_config()
    obj = get_objective(cfg)
    assert OBJECTIVES["forward-chained"] is ForwardChainedObjective
    assert obj.ce_kind == "exact" and obj.needs_upstream and obj.state_dim() == cfg.d_model
    assert [obj.upstream_blocks(b) for b in range(3)] == [0, 1, 2]
    assert not get_objective(tiny_config()).needs_upstream and get_objective(tiny_config()).upstream_blocks(2) == 0
    with pytest.raises(ValueError, match="needs 1 upstream snapshot"):
        obj.local_loss(obj.build_block(1), 1, windows(2, cfg.seq_len))


def test_a_block_step_touches_only_that_block():
    """Block 1's loss reads block 0's output, but no gradient reaches block 0 (or block 2)."""
    cfg = fc_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    before = [[p.detach().clone() for p in m.parameters()] for m in blocks]
    w = windows(4, cfg.seq_len)
    loss, _ = obj.local_loss(blocks[1], 1, w, upstream=blocks[:1])
    loss.backward()
    assert all(p.grad is None for b in (0, 2) for p in blocks[b].parameters())
    assert all(p.grad is not None for p in blocks[1].parameters())
    for m in blocks:
        m.zero_grad(set_to_none=True)
    opt = make_optimizer(blocks[1], cfg)
    optimizer_step(blocks[1], opt, cfg, 0, lambda: obj.local_loss(blocks[1], 1, w, upstream=blocks[:1]))
    for b in (0, 2):
        assert all(torch.equal(p, q) for p, q in zip(blocks[b].parameters(), before[b]))
    assert any(not torch.equal(p, q) for p, q in zip(blocks[1].parameters(), before[1]))
    assert blocks[0].training   # the upstream forward ran in eval mode and restored the mode


def test_block_loss_depends_on_upstream_weights():
    cfg = fc_config()
    obj = get_objective(cfg)
    b0, b1 = obj.build_block(0), obj.build_block(1)
    w = windows(4, cfg.seq_len)
    l1, _ = obj.local_loss(b1, 1, w, upstream=[b0])
    with torch.no_grad():
        b0.byte_emb.weight.mul_(5.0)
    l2, _ = obj.local_loss(b1, 1, w, upstream=[b0])
    assert abs(float(l1.detach()) - float(l2.detach())) > 1e-4


def test_chain_score_is_the_exact_ce_of_the_stack():
    cfg = fc_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b).eval() for b in range(cfg.n_blocks)]
    w = windows(3, cfg.seq_len, seed=1)
    ctx, y = w[:, :-1], w[:, 1:]
    res = obj.score(obj.local_hops(blocks), w)
    h = None
    manual = []
    with torch.no_grad():
        for m in blocks:
            h, logits = m(h, ctx)
            manual.append(float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))))
    assert res.ce_kind == "exact" and res.ce == pytest.approx(manual[-1], abs=1e-5)
    assert res.extra["prefix_ce"] == pytest.approx(manual, abs=1e-5)
    assert res.ce == pytest.approx(5.545, abs=0.1)   # untrained: about ln 256


def test_training_lowers_the_chain_ce_and_later_blocks_build_on_earlier_ones():
    cfg = fc_config(lr=3e-3)
    run = LocalRun(cfg, text_split(), torch.device("cpu"), reference=False)
    w = torch.from_numpy(np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 3,
                                       dtype=np.uint8)[:cfg.seq_len + 1].astype(np.int64)).unsqueeze(0)
    start = run.objective.score(run.objective.local_hops(run.blocks), w).ce
    for _ in range(60):
        run.round()
    res = run.objective.score(run.objective.local_hops(run.blocks), w)
    assert res.ce < start - 1.0, (start, res.ce)
    # block 2 reads features the other blocks made: zeroing its input hurts it
    alone = run.objective.block_alone_ce(run.blocks[2], 2, w)
    assert alone > res.ce + 0.5, (alone, res.ce)


def test_generation_is_one_traversal_per_byte_and_one_sweep_equals_autoregressive():
    cfg = fc_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b).eval() for b in range(cfg.n_blocks)]
    hops = [CountingHop(h) for h in obj.local_hops(blocks)]
    out = obj.generate_one_sweep(hops, b"hello", 7)
    assert len(out) == 7 and [h.calls for h in hops] == [7] * cfg.n_blocks
    assert out == obj.generate_autoregressive(obj.local_hops(blocks), b"hello", 7)


def test_flops_charge_upstream_forwards_and_bench_references_match_the_chain():
    cfg = fc_config(n_blocks=3)
    run = LocalRun(cfg, text_split(), torch.device("cpu"), reference=True, small_reference=True,
                   match_flops=True)
    for _ in range(4):
        run.round()
    f = run.flops()
    n, t, d, layers = cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.layers_per_block
    own = flop_formulas.ar_train_step(n, t, d, layers)          # a block's layers + its own head
    upstream = flop_formulas.stream_forward(n, t, d, layers)     # an upstream block: layers, no head
    assert f["block0"] == 4 * own
    assert f["block2"] == 4 * (own + 2 * upstream)
    assert [tr.upstream_flops for tr in run.trainees[:3]] == [0, upstream, 2 * upstream]
    assert run.round_flops() - run.round_flops_streamed() == pytest.approx(3 * upstream)  # 0 + 1 + 2
    # each reference took as many steps as the chain's FLOPs buy it (within one step)
    for name in ("reference", "reference_1block"):
        per_step = next(tr.step_flops for tr in run.trainees if tr.name == name)
        assert abs(f[name] - f["chain"]) <= per_step + 1e-6, name
    steps = {tr.name: tr.steps for tr in run.trainees}
    assert steps["block0"] == 4 and steps["reference_1block"] > 3 * steps["block0"]


def test_stale_upstream_snapshots_refresh_every_n_rounds():
    cfg = fc_config(n_blocks=2)
    run = LocalRun(cfg, text_split(), torch.device("cpu"), reference=False, upstream_every=3)
    seen = []
    for _ in range(7):
        snap = run._upstream(1)[0]
        seen.append((id(snap), snap.byte_emb.weight.detach().clone()))
        assert not any(p.requires_grad for p in snap.parameters())
        run.round()
    # rounds 0-2 share one snapshot, 3-5 the next, 6 a third; each differs from the live block 0
    assert seen[0][0] == seen[1][0] == seen[2][0] != seen[3][0]
    assert seen[3][0] == seen[4][0] == seen[5][0] != seen[6][0]
    assert not torch.equal(seen[2][1], seen[3][1])
    live = LocalRun(cfg, text_split(), torch.device("cpu"), reference=False)
    assert live._upstream(1)[0] is live.blocks[0]
