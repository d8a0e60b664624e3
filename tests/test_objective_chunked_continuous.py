"""The ``chunked-continuous`` objective (issue 8, candidate b): no leakage across chunks, a bound
whose scale is right (I-MMSE: a Bayes-optimal denoiser's bound is the data's entropy), the
discrete chain bound against the continuous one, gradient isolation, hop counts, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from blocktrain.blocks.chain import CountingHop, HopRequest
from blocktrain.blocks.config import ConfigError
from blocktrain.blocks.objectives import OBJECTIVES, get_objective
from blocktrain.blocks.objectives.chunked_continuous import ChunkedContinuousObjective
from blocktrain.blocks.train import make_optimizer, optimizer_step

from test_utils.configs import tiny_config

LN256 = math.log(256)


pytestmark = pytest.mark.usefixtures("one_thread")


def cc_config(**kw):
    base = dict(objective="chunked-continuous", chunk_len=4)
    base.update(kw)
    return tiny_config(**base)


def randomise(block, std=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return block.eval()


def windows(n, t, seed=0, high=256):
    return torch.randint(0, high, (n, t + 1), generator=torch.Generator().manual_seed(seed))


def test_registered_and_configured():
    assert OBJECTIVES["chunked-continuous"] is ChunkedContinuousObjective
    obj = get_objective(cc_config())
    assert obj.ce_kind == "bound" and obj.state_dim() == 16
    assert obj.train_tokens_per_window == 32 + 28                 # [noisy || clean] as chunked-masked
    s = obj.sigmas
    assert len(s) == 4 and bool((s[:-1] > s[1:]).all()) and float(s[0]) == 20.0 and float(s[-1]) == 0.02
    for bad in ([1.0, 2.0, 0.5, 0.1], [1.0, 0.5, 0.1], [1.0, 0.5, 0.1, 0.0], [1.0, 0.5, "x", 0.1]):
        with pytest.raises(ConfigError, match="extra.sigma_bounds"):
            get_objective(cc_config(extra={"sigma_bounds": bad}))
    for bad in (0, 2.5, True, 10**6):
        with pytest.raises(ConfigError, match="extra.steps_per_hop"):
            get_objective(cc_config(extra={"steps_per_hop": bad}))


def test_chunk_sees_no_later_byte_and_no_clean_byte_of_itself():
    cfg = cc_config()
    obj = get_objective(cfg)
    blk = randomise(obj.build_block(1))
    k, t = cfg.chunk_len, cfg.seq_len
    w = windows(3, t, seed=1)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, t, cfg.target_dim, generator=g)
    sig = torch.full((3, t), 0.7)
    j = 3
    lo, hi = j * k, (j + 1) * k

    def chunk_logits(win, zz):
        with torch.no_grad():
            return blk(win[:, :-1], zz, sig)[:, lo:hi]

    base = chunk_logits(w, z)
    w2, z2 = w.clone(), z.clone()
    w2[:, lo + 1:] = torch.randint(0, 256, w2[:, lo + 1:].shape, generator=g)   # chunk j's own clean bytes and later
    z2[:, hi:] = torch.randn(z2[:, hi:].shape, generator=g)                        # later noisy chunks
    assert torch.allclose(chunk_logits(w2, z2), base, atol=1e-4), "chunk j saw a clean byte it must predict"
    w3 = w.clone()
    w3[:, lo] = (w3[:, lo] + 1) % 256            # the clean byte before the chunk matters
    assert not torch.allclose(chunk_logits(w3, z), base, atol=1e-3)
    z3 = z.clone()
    z3[:, lo + 2] += 0.5                         # so does the chunk's own noisy state
    assert not torch.allclose(chunk_logits(w, z3), base, atol=1e-3)


def _iid_model(obj, cfg, log_p):
    """Blocks whose network output is the log-prior log_p of every byte: with the exact Gaussian
    likelihood this is the Bayes-optimal denoiser for i.i.d. bytes drawn from p."""
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    for m in blocks:
        with torch.no_grad():
            m.net.head.weight.zero_()
            m.net.head.bias.copy_(log_p)
    return blocks


@pytest.mark.parametrize("support", [256, 4])
def test_bound_of_a_bayes_optimal_denoiser_is_the_entropy(support):
    """I-MMSE (Guo, Shamai, Verdu 2005; Kong et al. 2023): with the exact posterior mean the
    continuous bound equals H(y) up to the prior and reconstruction terms (both tiny here). So the
    loss weights, the sum over blocks and the nats/byte scale are right, for uniform bytes (ln 256)
    and for bytes from 4 values (ln 4). The discrete chain bound sits above it and tightens with m."""
    log_p = torch.full((256,), -1e4)
    log_p[:support] = -math.log(support)
    w = windows(64, 32, seed=3, high=support)
    got = {}
    for m in (8, 64):
        cfg = cc_config(extra={"steps_per_hop": m})
        obj = get_objective(cfg)
        hops = obj.local_hops(_iid_model(obj, cfg, log_p))
        g = torch.Generator().manual_seed(0)
        cont = [obj.continuous_nelbo(hops, w, g)[0] for _ in range(6)]
        res = obj.score(hops, w, k=6, generator=g)
        got[m] = res.ce
        c = sum(cont) / len(cont)
        assert c == pytest.approx(math.log(support), abs=0.12), (m, cont)
        assert res.ce > c - 0.15
    assert got[64] < got[8]
    assert got[64] - math.log(support) < 0.5


def test_block_losses_add_up_to_the_continuous_bound_and_training_lowers_it():
    cfg = cc_config(seq_len=16, n_blocks=2, d_model=32, lr=3e-3)
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(2)]
    data = torch.tensor(list(b"the cat sat on the mat. " * 40))
    w = torch.stack([data[s:s + 17] for s in range(0, len(data) - 17, 3)])
    g = torch.Generator().manual_seed(0)
    hops = obj.local_hops(blocks)
    before = obj.score(hops, w[:16], k=2, generator=g)
    nelbo, local = obj.continuous_nelbo(hops, w[:16], g)
    recon_and_prior = nelbo - sum(local)
    assert 0 <= recon_and_prior < 0.05
    for b, m in enumerate(blocks):
        opt = make_optimizer(m, cfg)
        for step in range(30):
            batch = w[torch.randint(0, len(w), (8,), generator=g)]
            optimizer_step(m, opt, cfg, step, lambda: obj.local_loss(m, b, batch, g))
    after = obj.score(obj.local_hops(blocks), w[:16], k=2, generator=g)
    assert after.ce < before.ce - 1.0, (before.ce, after.ce)
    assert after.extra["nelbo_continuous"] < before.extra["nelbo_continuous"] - 1.0


def test_a_block_step_touches_only_that_block():
    cfg = cc_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    before = [[p.detach().clone() for p in m.parameters()] for m in blocks]
    w = windows(4, cfg.seq_len)
    opt = make_optimizer(blocks[1], cfg)
    optimizer_step(blocks[1], opt, cfg, 0, lambda: obj.local_loss(blocks[1], 1, w, torch.Generator().manual_seed(0)))
    for b in (0, 2):
        assert all(torch.equal(p, q) for p, q in zip(blocks[b].parameters(), before[b]))
        assert all(p.grad is None for p in blocks[b].parameters())
    assert any(not torch.equal(p, q) for p, q in zip(blocks[1].parameters(), before[1]))


def test_one_sweep_is_one_traversal_per_chunk_and_ar_one_per_byte():
    cfg = cc_config(extra={"steps_per_hop": 4})
    obj = get_objective(cfg)
    blocks = [randomise(obj.build_block(b), seed=b) for b in range(cfg.n_blocks)]
    for prompt, n in [(b"hi", 11), (b"x" * 100, 28), (b"", 1)]:
        hops = [CountingHop(h) for h in obj.local_hops(blocks)]
        out = obj.generate_one_sweep(hops, prompt, n, temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert isinstance(out, bytes) and len(out) == n
        assert [h.calls for h in hops] == [math.ceil(n / cfg.chunk_len)] * cfg.n_blocks
    hops = [CountingHop(h) for h in obj.local_hops(blocks)]
    out = obj.generate_autoregressive(hops, b"hello", 6)
    assert len(out) == 6 and [h.calls for h in hops] == [6] * cfg.n_blocks
    a = obj.generate_one_sweep(obj.local_hops(blocks), b"ab", 9)       # greedy: deterministic
    assert a == obj.generate_one_sweep(obj.local_hops(blocks), b"ab", 9)


def test_hop_takes_its_substeps_and_rejects_bad_states():
    cfg = cc_config(extra={"steps_per_hop": 5})
    obj = get_objective(cfg)
    blk = randomise(obj.build_block(0))
    calls = []
    orig = blk.forward
    blk.forward = lambda *a: (calls.append(1), orig(*a))[1]
    hop = obj.make_hop(blk, 0)
    lo, hi = obj.sigma_range(0)
    ctx = windows(2, 8)[:, :-1]
    z = torch.randn(2, 8, cfg.target_dim)
    out = hop(HopRequest(z, ctx, torch.full((2,), hi), torch.full((2,), lo), want_logits=True))
    assert len(calls) == 5 and out.state.shape == z.shape and out.logits.shape == (2, 8, 256)
    calls.clear()
    one = (hi / lo) ** (1 / 5)
    hop(HopRequest(z, ctx, torch.full((2,), hi), torch.full((2,), hi / one)))
    assert len(calls) == 1
    for bad_z, s, sn in [(z.clone().fill_(float("nan")), hi, lo), (z, hi, 0.0), (z, lo, hi)]:
        with pytest.raises(ValueError, match="chunked-continuous hop"):
            hop(HopRequest(bad_z, ctx, torch.full((2,), s), torch.full((2,), sn)))
