"""The ``chunked-masked`` objective (issue 8, candidate a): leakage, the exact split of the bound
into block losses, the chain bound against exact enumeration, hop counts, gradient isolation."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from blocktrain.blocks.chain import CountingHop, HopRequest
from blocktrain.blocks.config import ConfigError
from blocktrain.blocks.objectives import OBJECTIVES, get_objective
from blocktrain.blocks.objectives.chunked_masked import ChunkedMaskedObjective
from blocktrain.blocks.objectives.chunked_masked.net import MASK_ID, block_causal_mask
from blocktrain.blocks.train import make_optimizer, optimizer_step

from test_utils.configs import tiny_config

LN256 = math.log(256)


pytestmark = pytest.mark.usefixtures("one_thread")


def cm_config(**kw):
    base = dict(objective="chunked-masked", chunk_len=4)
    base.update(kw)
    return tiny_config(**base)


def randomise(block, std=0.2, seed=0):
    """Non-trivial weights on every path (the head starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return block.eval()


def windows(n, t, seed=0):
    return torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(seed))


# -- registry and config ------------------------------------------------------------------------------
def test_registered_and_configured():
    assert OBJECTIVES["chunked-masked"] is ChunkedMaskedObjective and "paper" in OBJECTIVES
    obj = get_objective(cm_config())
    assert obj.ce_kind == "bound" and obj.state_dim() == 2
    # [noisy || clean]: T noisy positions + every chunk but the last as clean positions
    assert obj.train_tokens_per_window == 32 + 28
    with pytest.raises(ConfigError, match="extra.mask_rates"):
        get_objective(cm_config(extra={"mask_rates": [1.0, 0.2, 0.5, 0.0]}))
    with pytest.raises(ConfigError, match="extra.reveal_order"):
        get_objective(cm_config(extra={"reveal_order": "sideways"}))


def test_block_causal_mask_layout():
    m = block_causal_mask(5, 2)          # chunks {0,1} {2,3} {4}; clean stream: 4 positions
    assert m.shape == (9, 9)
    noisy_noisy, noisy_clean, clean_noisy, clean_clean = m[:5, :5], m[:5, 5:], m[5:, :5], m[5:, 5:]
    c = torch.tensor([0, 0, 1, 1, 2])
    assert torch.equal(noisy_noisy, c.view(-1, 1) == c.view(1, -1))
    assert torch.equal(noisy_clean, c[:4].view(1, -1) < c.view(-1, 1))
    assert not clean_noisy.any()
    assert torch.equal(clean_clean, c[:4].view(1, -1) <= c[:4].view(-1, 1))


# -- leakage ------------------------------------------------------------------------------------------
def test_chunk_predictions_see_no_masked_or_later_bytes():
    cfg = cm_config()
    obj = get_objective(cfg)
    blk = randomise(obj.build_block(1))
    k, t = cfg.chunk_len, cfg.seq_len
    w = windows(3, t, seed=1)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(3, t, generator=g) < 0.5
    j = 3                                              # chunk j = y positions [12, 16) = window bytes 13..16
    lo, hi = j * k, (j + 1) * k
    mask[:, lo] = True
    mask[:, lo + 1] = False

    def chunk_logits(win):
        ids = torch.where(mask, torch.full_like(win[:, 1:], MASK_ID), win[:, 1:])
        with torch.no_grad():
            return blk(win[:, :-1], ids)[:, lo:hi]

    base = chunk_logits(w)
    w2 = w.clone()
    w2[:, hi + 1:] = torch.randint(0, 256, w2[:, hi + 1:].shape, generator=g)   # every later chunk
    for r in range(3):                                                             # masked bytes of chunk j
        for i in range(lo, hi):
            if bool(mask[r, i]):
                w2[r, i + 1] = (w[r, i + 1] + 7) % 256
    assert torch.allclose(chunk_logits(w2), base, atol=1e-5), "chunk j saw a masked or later byte"
    # the test is sensitive: a clean byte before the chunk, or a visible byte inside it, matters
    w3 = w.clone()
    w3[:, lo] = (w3[:, lo] + 1) % 256           # y_{lo-1}: last byte of chunk j-1
    assert not torch.allclose(chunk_logits(w3), base, atol=1e-4)
    w4 = w.clone()
    w4[:, lo + 2] = (w4[:, lo + 2] + 1) % 256   # y_{lo+1}: unmasked inside chunk j
    assert not torch.allclose(chunk_logits(w4), base, atol=1e-4)


def test_hop_ignores_context_beyond_its_chunk_start():
    cfg = cm_config()
    obj = get_objective(cfg)
    hop = obj.make_hop(randomise(obj.build_block(0)), 0)
    k = cfg.chunk_len
    t_len = 3 * k                        # generation-style request: two clean chunks + one noisy chunk
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 256, (2, t_len), generator=g)
    state = torch.zeros(2, t_len, 2)
    state[:, :, 0] = MASK_ID
    state[:, :, 1] = torch.rand(2, t_len, generator=g)
    s, sn = torch.ones(2), torch.full((2,), 0.5)
    a = hop(HopRequest(state, ctx, s, sn, want_logits=True))
    ctx2 = ctx.clone()
    ctx2[:, 2 * k + 1:] = (ctx2[:, 2 * k + 1:] + 5) % 256
    b = hop(HopRequest(state, ctx2, s, sn, want_logits=True))
    assert torch.allclose(a.logits[:, 2 * k:], b.logits[:, 2 * k:], atol=1e-5)
    # the state contract: same shape, reveals exactly the masked bytes with tau >= t_next
    assert a.state.shape == state.shape and a.logits.shape == (2, t_len, 256)
    revealed = a.state[..., 0] != MASK_ID
    assert torch.equal(revealed, state[..., 1] >= 0.5)
    assert torch.equal(a.state[..., 1], state[..., 1])


# -- the bound splits exactly into block losses ---------------------------------------------------------
def _beta_poly_integral(a: int, c: int, lo: float, hi: float) -> float:
    """int_lo^hi t^a (1-t)^c dt, exactly (binomial expansion)."""
    return sum(math.comb(c, j) * (-1) ** j * (hi ** (a + j + 1) - lo ** (a + j + 1)) / (a + j + 1)
               for j in range(c + 1))


def test_block_losses_sum_exactly_to_the_global_bound():
    """Enumerate every mask of a chunk of k=3: the width-weighted sum of the blocks' expected local
    losses equals the masked-diffusion NELBO int_0^1 (1/t) E[sum_masked CE] dt, exactly; and the
    training sampler draws masks with exactly the distribution this identity uses."""
    rates = [1.0, 0.7, 0.2, 0.0]
    cfg = cm_config(seq_len=3, chunk_len=3, n_blocks=3, extra={"mask_rates": rates})
    obj = get_objective(cfg)
    blk = randomise(obj.build_block(0)).double()
    k = 3
    w = windows(1, 3, seed=3)
    subsets = [s for r in range(1, k + 1) for s in itertools.combinations(range(k), r)]
    ce = {}
    for s in subsets:
        mask = torch.zeros(1, k, dtype=torch.bool)
        mask[0, list(s)] = True
        ids = torch.where(mask, torch.full_like(w[:, 1:], MASK_ID), w[:, 1:])
        with torch.no_grad():
            lp = torch.log_softmax(blk(w[:, :-1], ids), -1)[0]
        ce[s] = {i: -float(lp[i, w[0, i + 1]]) for i in s}
        # masked_ce_per_chunk is the mean CE over the masked bytes
        with torch.no_grad():
            got = float(obj.masked_ce_per_chunk(blk, w, mask)[0, 0])
        assert got == pytest.approx(sum(ce[s].values()) / len(s), rel=1e-6)

    # global NELBO per byte: sum_M B(|M|, k-|M|+1) * sum_{i in M} CE_i(M) / k
    glob = sum(math.gamma(len(s)) * math.gamma(k - len(s) + 1) / math.gamma(k + 1) * sum(ce[s].values())
               for s in subsets) / k

    def p_block(b, s):    # P(S) under block b's sampler: (1/|R_b|) int_{R_b} (|S|/k) t^{|S|-1} (1-t)^{k-|S|} dt
        lo, hi = obj.rate_range(b)
        return len(s) / k * _beta_poly_integral(len(s) - 1, k - len(s), lo, hi) / (hi - lo)

    total, expected = 0.0, []
    for b in range(3):
        assert sum(p_block(b, s) for s in subsets) == pytest.approx(1.0, abs=1e-12)
        e_b = sum(p_block(b, s) * sum(ce[s].values()) / len(s) for s in subsets)
        expected.append(e_b)
        total += obj.range_width(b) * e_b
    assert total == pytest.approx(glob, rel=1e-10)

    g = torch.Generator().manual_seed(0)
    n = 20_000
    for b in range(3):
        # the sampler's mask distribution matches P_b(S)
        mask, t = obj.sample_training_mask(b, n, k, g)
        lo, hi = obj.rate_range(b)
        assert float(t.min()) >= lo and float(t.max()) <= hi
        codes = (mask.long() * torch.tensor([1, 2, 4])).sum(1)
        freq = torch.bincount(codes, minlength=8).double() / n
        assert float(freq[0]) == 0.0, "every chunk has at least one masked byte"
        for s in subsets:
            code = sum(1 << i for i in s)
            p = p_block(b, s)
            assert float(freq[code]) == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / n) + 1e-9)
        # and local_loss is an unbiased estimate of the block's expected loss
        vals = [sum(ce[s].values()) / len(s) for s in subsets]
        with torch.no_grad():
            loss, stats = obj.local_loss(blk, b, w.repeat(4000, 1), g)
        sd = (max(vals) - min(vals)) / 2
        assert float(loss) == pytest.approx(expected[b], abs=5 * sd / math.sqrt(4000) + 1e-9)
        assert stats["bound_share"] == pytest.approx(float(loss) * obj.range_width(b))


# -- the chain bound ----------------------------------------------------------------------------------
def test_chain_bound_matches_exact_enumeration_and_bounds_the_nll():
    """k=2, B=2: every reveal path of a chunk is enumerable. The chain's ELBO matches the exact
    expectation, the left-to-right bound is exact, and NLL <= IWAE_K <~ ELBO."""
    rates = [1.0, 0.4, 0.0]
    cfg = cm_config(seq_len=4, chunk_len=2, n_blocks=2, extra={"mask_rates": rates})
    obj = get_objective(cfg)
    blocks = [randomise(obj.build_block(b), seed=b) for b in range(2)]
    hops = obj.local_hops(blocks)
    w = windows(3, 4, seed=5)
    y = w[:, 1:]
    p_hop = [rates[0] - rates[1], rates[1] - rates[2]]

    def logp(b, revealed_before):        # log p_b(y | positions in revealed_before known), (N, T)
        mask = torch.ones_like(y, dtype=torch.bool)
        mask[:, revealed_before] = False
        ids = torch.where(mask, torch.full_like(y, MASK_ID), y)
        with torch.no_grad():
            return torch.log_softmax(blocks[b](w[:, :-1], ids).double(), -1).gather(-1, y.unsqueeze(-1))[..., 0]

    elbo = torch.zeros(3, dtype=torch.float64)
    nll = torch.zeros(3, dtype=torch.float64)
    l2r = torch.zeros(3, dtype=torch.float64)
    for c in range(2):
        pos = [2 * c, 2 * c + 1]
        like = torch.zeros(3, dtype=torch.float64)
        for hop_of in itertools.product(range(2), repeat=2):           # which hop reveals each byte
            prob = p_hop[hop_of[0]] * p_hop[hop_of[1]]
            early = [p for p, h in zip(pos, hop_of) if h == 0]
            lw = sum(logp(h, [] if h == 0 else early)[:, p] for p, h in zip(pos, hop_of))
            elbo -= prob * lw
            like += prob * lw.exp()
            if hop_of == (0, 1):
                l2r -= lw
        nll -= like.log()
    elbo, nll, l2r = [float(v.mean() / 4) for v in (elbo, nll, l2r)]
    assert nll < elbo

    fixed = obj.chain_bound(hops, w, 1, "left-to-right")
    assert fixed["elbo"] == pytest.approx(l2r, rel=1e-5) and fixed["iwae"] == pytest.approx(l2r, rel=1e-5)

    res = obj.score(hops, w, k=600, generator=torch.Generator().manual_seed(0))
    assert res.ce_kind == "bound" and res.k == 600
    assert res.ce_k1 == pytest.approx(elbo, abs=0.02)
    assert nll - 0.01 <= res.ce <= res.ce_k1 + 1e-9
    assert abs(res.ce - nll) < abs(res.ce_k1 - nll)
    # the held-out continuous-time estimate is the width-weighted sum of the per-block losses
    assert res.extra["nelbo_continuous"] == pytest.approx(
        sum(obj.range_width(b) * v for b, v in enumerate(res.extra["block_local_loss"])))


def test_untrained_chain_bound_is_ln256_and_training_lowers_it():
    cfg = cm_config(seq_len=16, chunk_len=4, n_blocks=2, d_model=32, lr=3e-3)
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(2)]
    text = (b"the cat sat on the mat. " * 40)
    data = torch.tensor(list(text))
    starts = torch.arange(0, len(text) - 17, 3)
    w = torch.stack([data[s:s + 17] for s in starts])
    g = torch.Generator().manual_seed(0)
    res = obj.score(obj.local_hops(blocks), w[:8], k=2, generator=g)
    assert res.ce == pytest.approx(LN256, abs=1e-5) and res.ce_k1 == pytest.approx(LN256, abs=1e-5)
    assert obj.block_alone_ce(blocks[0], 0, w[:8], g) == pytest.approx(LN256, abs=1e-5)
    for b, m in enumerate(blocks):
        opt = make_optimizer(m, cfg)
        for step in range(25):
            batch = w[torch.randint(0, len(w), (8,), generator=g)]
            optimizer_step(m, opt, cfg, step, lambda: obj.local_loss(m, b, batch, g))
    res = obj.score(obj.local_hops(blocks), w[:8], k=2, generator=g)
    assert res.ce_k1 < 0.6 * LN256, res     # the chain's ELBO (K=1) of the trained blocks
    assert res.ce < 0.6 * LN256, res


# -- gradient isolation -------------------------------------------------------------------------------
def test_a_block_step_touches_only_that_block():
    cfg = cm_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    before = [[p.detach().clone() for p in m.parameters()] for m in blocks]
    w = windows(4, cfg.seq_len)
    loss, _ = obj.local_loss(blocks[1], 1, w, torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for b in (0, 2) for p in blocks[b].parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks[1].parameters())
    for m in blocks:
        m.zero_grad(set_to_none=True)
    opt = make_optimizer(blocks[1], cfg)
    optimizer_step(blocks[1], opt, cfg, 0, lambda: obj.local_loss(blocks[1], 1, w, torch.Generator().manual_seed(0)))
    for b in (0, 2):
        assert all(torch.equal(p, q) for p, q in zip(blocks[b].parameters(), before[b]))
    assert any(not torch.equal(p, q) for p, q in zip(blocks[1].parameters(), before[1]))


# -- generation: hop counts ------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["random", "left-to-right"])
def test_one_sweep_is_one_traversal_per_chunk(order):
    cfg = cm_config(extra={"reveal_order": order})
    obj = get_objective(cfg)
    blocks = [randomise(obj.build_block(b), seed=b) for b in range(cfg.n_blocks)]
    for prompt, n in [(b"hi", 11), (b"x" * 100, 40), (b"", 1)]:
        hops = [CountingHop(h) for h in obj.local_hops(blocks)]
        out = obj.generate_one_sweep(hops, prompt, n, generator=torch.Generator().manual_seed(0))
        assert isinstance(out, bytes) and len(out) == n
        assert [h.calls for h in hops] == [math.ceil(n / cfg.chunk_len)] * cfg.n_blocks
    hops = [CountingHop(h) for h in obj.local_hops(blocks)]
    out = obj.generate_autoregressive(hops, b"hello", 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(out) == 6 and [h.calls for h in hops] == [6] * cfg.n_blocks
    # greedy one-sweep is deterministic for a fixed reveal order
    a = obj.generate_one_sweep(obj.local_hops(blocks), b"ab", 9, generator=torch.Generator().manual_seed(1))
    b = obj.generate_one_sweep(obj.local_hops(blocks), b"ab", 9, generator=torch.Generator().manual_seed(1))
    assert a == b


def test_left_to_right_one_sweep_equals_autoregressive_when_each_hop_reveals_one_byte():
    """k = B and the left-to-right order: hop b reveals byte b of the chunk, so one traversal per
    chunk decides the same bytes, from the same inputs, as one traversal per byte."""
    cfg = cm_config(chunk_len=3, n_blocks=3, extra={"reveal_order": "left-to-right"})
    obj = get_objective(cfg)
    blocks = [randomise(obj.build_block(b), seed=b) for b in range(3)]
    hops = obj.local_hops(blocks)
    assert obj.generate_one_sweep(hops, b"some text", 10) == obj.generate_autoregressive(hops, b"some text", 10)


# -- compute accounting -----------------------------------------------------------------------------------
def test_flop_count_charges_a_block_for_its_longer_training_forward():
    """A chunked-masked block runs [noisy || clean] positions per window: equal-compute tables must
    charge it for them, and the reference only for seq_len."""
    import numpy as np

    from blocktrain.blocks.data import DataSplit
    from blocktrain.blocks.flops import train_flops_per_step
    from blocktrain.blocks.local_run import LocalRun
    from test_utils import flop_formulas

    cfg = cm_config(n_blocks=2)
    obj = get_objective(cfg)
    assert obj.train_tokens_per_window > cfg.seq_len
    assert get_objective(tiny_config()).train_tokens_per_window == cfg.seq_len   # paper: one pass
    data = np.frombuffer(b"the cat sat on the mat. " * 40, dtype=np.uint8)
    run = LocalRun(cfg, DataSplit(data, data, "test", "in-memory"), torch.device("cpu"))
    run.round()
    f = run.flops()
    bs = cfg.batch_size
    # measured counts: the block is charged for its [noisy || clean] window (matmuls grow with the
    # positions: well above what seq_len positions of the same block would cost) ...
    longer = obj.train_tokens_per_window / cfg.seq_len
    assert f["block0"] > 0.8 * longer * train_flops_per_step(run.blocks[0], bs, cfg.seq_len)
    # ... and the reference exactly for seq_len positions
    assert f["reference"] == flop_formulas.ar_train_step(bs, cfg.seq_len, cfg.d_model, cfg.reference_layers)
    assert f["chain"] == f["block0"] + f["block1"]
