"""The model core: schedule, EDM identities, leakage, isolation, chain traversal, config."""
from __future__ import annotations

import json
import math

import pytest
import torch

from blocktrain.blocks.chain import CountingHop, HopResult
from blocktrain.blocks.config import ConfigError, ModelConfig
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.objectives.paper.schedule import NoiseSchedule, edm_coefficients, edm_loss_weight
from blocktrain.blocks.train import make_optimizer, optimizer_step

from test_utils.configs import tiny_config


# -- schedule -------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [0.0, 0.25])
def test_partition_has_equal_mass_and_covers_the_range(overlap):
    cfg = ModelConfig(n_blocks=5, sigma_min=0.5, sigma_max=20.0, overlap=overlap)
    s = NoiseSchedule(cfg)
    b = s.boundaries()
    assert float(b[0]) == pytest.approx(20.0) and float(b[-1]) == pytest.approx(0.5)
    assert torch.all(b[:-1] > b[1:]), "boundaries must descend: block 0 holds the highest noise"
    masses = s.mass_above(b)
    assert torch.allclose(masses[1:] - masses[:-1], torch.full((5,), 0.2, dtype=torch.float64), atol=1e-6)
    # empirical: sampling the whole truncated density lands 1/B of the draws in each range
    g = torch.Generator().manual_seed(0)
    u = torch.rand(200_000, generator=g, dtype=torch.float64)
    draws = s.sigma_at_mass(u)
    counts = torch.histc(s.mass_above(draws), bins=5, min=0, max=1)
    assert torch.allclose(counts / counts.sum(), torch.full((5,), 0.2, dtype=torch.float64), atol=0.01)
    for blk in range(5):
        lo, hi = s.block_range(blk)
        x = s.sample(blk, 2000, g)
        assert x.min() >= lo - 1e-4 and x.max() <= hi + 1e-4
        if overlap == 0:
            assert lo == pytest.approx(float(b[blk + 1]), rel=1e-5) and hi == pytest.approx(float(b[blk]), rel=1e-5)
        else:
            assert lo < float(b[blk + 1]) or blk == 4
            assert hi > float(b[blk]) or blk == 0


def test_edm_identities():
    sd = 0.5
    sigma = torch.logspace(-3, 2, 50, dtype=torch.float64)
    c = edm_coefficients(sigma, sd)
    assert torch.allclose(c.c_in**2 * (sigma**2 + sd**2), torch.ones_like(sigma))
    assert torch.allclose(c.c_skip + sigma**2 / (sigma**2 + sd**2), torch.ones_like(sigma))
    assert torch.allclose(edm_loss_weight(sigma, sd) * c.c_out**2, torch.ones_like(sigma))
    assert torch.allclose(c.c_noise, sigma.log() / 4)
    # the training target of the raw network, (x - c_skip z) / c_out, has unit variance
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=g, dtype=torch.float64) * sd
    for s in (0.01, 1.0, 30.0):
        cs = edm_coefficients(torch.tensor(s, dtype=torch.float64), sd)
        z = x + s * torch.randn(x.shape, generator=g, dtype=torch.float64)
        assert float(((x - cs.c_skip * z) / cs.c_out).var()) == pytest.approx(1.0, rel=0.02)
        # and the network input c_in z has unit variance too
        assert float((cs.c_in * z).var()) == pytest.approx(1.0, rel=0.02)


# -- leakage ----------------------------------------------------------------------------------------
def test_logits_at_t_do_not_see_bytes_or_noisy_targets_after_t():
    cfg = tiny_config()
    obj = get_objective(cfg)
    blk = obj.build_block(1)
    for p in blk.parameters():   # make every path non-trivial (the head starts at zero)
        torch.nn.init.normal_(p, std=0.2)
    blk.eval()
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 256, (2, cfg.seq_len), generator=g)
    z = torch.randn(2, cfg.seq_len, cfg.target_dim, generator=g)
    sigma = torch.tensor([1.5, 3.0])
    _, logits = blk(z, sigma, ctx)
    t = 10
    ctx2, z2 = ctx.clone(), z.clone()
    ctx2[:, t + 1:] = torch.randint(0, 256, ctx2[:, t + 1:].shape, generator=g)
    z2[:, t + 1:] = torch.randn(z2[:, t + 1:].shape, generator=g) * 10
    _, logits2 = blk(z2, sigma, ctx2)
    assert torch.allclose(logits[:, : t + 1], logits2[:, : t + 1], atol=1e-5)
    # the check has teeth: changing byte t DOES change the logits at t
    ctx3 = ctx.clone()
    ctx3[:, t] = (ctx3[:, t] + 1) % 256
    _, logits3 = blk(z, sigma, ctx3)
    assert not torch.allclose(logits[:, t], logits3[:, t], atol=1e-5)


def test_chain_score_never_reads_the_scored_bytes():
    """Changing the last byte of a window changes only the target, never the chain's prediction."""
    cfg = tiny_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    for m in blocks:
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2)
    seen = []

    def spy(hop):
        def call(req):
            seen.append(req.context.clone())
            return hop(req)
        return call

    hops = [spy(h) for h in obj.local_hops(blocks)]
    w = torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    obj.score(hops, w, k=1, generator=torch.Generator().manual_seed(0))
    for ctx in seen:
        assert torch.equal(ctx, w[:, :-1]), "hops may only see the context bytes x_<=t"


# -- isolation --------------------------------------------------------------------------------------
def test_a_step_on_block_b_touches_only_block_b():
    cfg = tiny_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    opts = [make_optimizer(m, cfg) for m in blocks]
    for m, o in zip(blocks, opts):   # one step each so every optimizer has state
        w = torch.randint(0, 256, (4, cfg.seq_len + 1))
        optimizer_step(m, o, cfg, 0, lambda m=m, w=w, b=blocks.index(m): obj.local_loss(m, b, w))
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in blocks]
    opt_before = [{id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                   for p, s in o.state.items()} for o in opts]
    w = torch.randint(0, 256, (4, cfg.seq_len + 1))
    optimizer_step(blocks[1], opts[1], cfg, 1, lambda: obj.local_loss(blocks[1], 1, w))
    for b, m in enumerate(blocks):
        changed = any(not torch.equal(v, before[b][k]) for k, v in m.state_dict().items())
        assert changed == (b == 1), f"block {b} parameters changed={changed}"
        o_changed = any(not torch.equal(v, opt_before[b][id(p)][k])
                        for p, s in opts[b].state.items() for k, v in s.items() if torch.is_tensor(v))
        assert o_changed == (b == 1), f"block {b} optimizer state changed={o_changed}"
    # blocks share no trainable parameter (the target table is a non-persistent, frozen buffer)
    ids = [{id(p) for p in m.parameters()} for m in blocks]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2])
    assert "target.table" not in blocks[0].state_dict()
    assert torch.equal(blocks[0].target.table, blocks[2].target.table)


# -- chain ------------------------------------------------------------------------------------------
def test_one_sweep_calls_each_block_once_autoregressive_once_per_byte():
    cfg = tiny_config()
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    hops = [CountingHop(h) for h in obj.local_hops(blocks)]
    out = obj.generate_one_sweep(hops, b"Hello", 12, generator=torch.Generator().manual_seed(0))
    assert len(out) == 12
    assert [h.calls for h in hops] == [1] * cfg.n_blocks
    out = obj.generate_autoregressive(hops, b"Hello", 5, generator=torch.Generator().manual_seed(0))
    assert len(out) == 5
    assert [h.calls for h in hops] == [1 + 5] * cfg.n_blocks
    with pytest.raises(ValueError, match="at most"):
        obj.generate_one_sweep(hops, b"x", cfg.seq_len, generator=None)


def test_chain_score_is_the_k_sample_mixture_ce_of_the_last_hops_logits():
    """Hops with known logits: sample i of K gives the scored byte probability p[i] (row 0) or 0.9
    (row 1). The score must be -log of the K-sample MIXTURE probability (``ce``) and the mean
    single-sample -log p (``ce_k1``), computed here by hand."""
    cfg = tiny_config()
    obj = get_objective(cfg)
    n, t, k = 2, cfg.seq_len, 4
    p = [[0.5, 0.1, 0.2, 0.2], [0.9, 0.9, 0.9, 0.9]]        # [row][sample]
    w = torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(3))
    calls = []

    def last_hop(req):
        i = len(calls)
        calls.append(req)
        logits = torch.zeros(n, t, 256)
        for row in range(n):       # logit a on the scored byte, 0 elsewhere: softmax = p[row][i] there
            a = math.log(255 * p[row][i] / (1 - p[row][i]))
            logits[row].scatter_(-1, w[row, 1:].unsqueeze(-1), a)
        return HopResult(req.state, logits if req.want_logits else None)

    hops = [lambda req: HopResult(req.state)] * (cfg.n_blocks - 1) + [last_hop]
    r = obj.score(hops, w, k=k, generator=torch.Generator().manual_seed(0))
    assert len(calls) == k and all(torch.equal(c.context, w[:, :-1]) for c in calls)
    mixture = [-math.log(sum(row) / k) for row in p]                      # per row: ln 4 and -ln 0.9
    single = [-sum(math.log(x) for x in row) / k for row in p]
    assert r.ce == pytest.approx(sum(mixture) / n, abs=1e-5)
    assert r.ce_k1 == pytest.approx(sum(single) / n, abs=1e-5)
    assert r.k == k and r.tokens == n * t and r.ce_kind == "exact"


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("d_model", 30), ("n_blocks", 0), ("sigma_min", -1.0), ("sigma_max", 0.5), ("seq_len", 1),
    ("overlap", 1.5), ("p_std", 0.0), ("lr", float("nan")), ("vocab_size", 300),
])
def test_bad_config_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig.from_dict({field: value})


def test_config_files_load_validate_and_hash_stably(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[model]\nn_blocks = 2\nd_model = 64\nsigma_max = 20\n')
    cfg = ModelConfig.load(p)
    assert cfg.n_blocks == 2 and cfg.sigma_max == 20.0
    assert cfg.config_hash == ModelConfig(n_blocks=2, d_model=64, sigma_max=20.0).config_hash
    assert cfg.config_hash != ModelConfig(n_blocks=2, d_model=64, sigma_max=21.0).config_hash
    assert cfg.config_hash == cfg.replace(lr=0.1, batch_size=3).config_hash  # training knobs don't
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"n_blocks": "four"}))
    with pytest.raises(ConfigError, match="'n_blocks'.*int"):
        ModelConfig.load(j)
    (tmp_path / "bad.toml").write_text("n_blocks = = 3")
    with pytest.raises(ConfigError, match="bad.toml.*TOML"):
        ModelConfig.load(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="unknown field"):
        ModelConfig.from_dict({"n_blokcs": 3})
    with pytest.raises(ConfigError, match="objective"):
        get_objective(ModelConfig(objective="nope"))


def test_fused_adaln_norm_matches_the_composed_ops_and_keeps_fewer_activations():
    from blocktrain.blocks.modulated_norm import modulated_layer_norm
    torch.manual_seed(0)
    for shape in [(3, 1, 8), (3, 5, 8)]:   # per-sequence and per-position modulation
        x = torch.randn(3, 5, 8, dtype=torch.double, requires_grad=True)
        s = torch.randn(*shape, dtype=torch.double, requires_grad=True)
        b = torch.randn(*shape, dtype=torch.double, requires_grad=True)
        assert torch.autograd.gradcheck(modulated_layer_norm, (x, s, b))
        composed = torch.addcmul(b, torch.nn.functional.layer_norm(x, (8,)), 1 + s)
        assert torch.allclose(modulated_layer_norm(x, s, b), composed, atol=1e-12)

    def saved_bytes(fn):
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel()) or t, lambda t: t):
            fn()
        return sum(total)
    x = torch.randn(4, 16, 32, requires_grad=True)
    s, b = (torch.randn(4, 1, 32, requires_grad=True) for _ in range(2))
    w = torch.nn.Linear(32, 32)
    fused = saved_bytes(lambda: w(modulated_layer_norm(x, s, b)))
    plain = saved_bytes(lambda: w(torch.addcmul(b, torch.nn.functional.layer_norm(x, (32,)), 1 + s)))
    assert fused <= plain - x.numel()   # one (N, T, d) activation fewer per use
