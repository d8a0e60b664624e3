"""Issue 13's ``pipeline-chunked`` objective in one process (no network; the engine's gradients on
real processes are in test_pipeline_grads.py): every byte of chunk c is predicted from the bytes
before the chunk only (a proper factorized distribution, scored exactly), its clean stream is the
``pipeline`` model's, n bytes take ceil(n / k) traversals one-sweep (n autoregressively). Its CE
falls when trained in LocalRun and its checkpoint loads: test_pipeline_objectives.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from blocktrain.blocks.chain import CountingHop
from blocktrain.blocks.objectives import get_objective

from test_utils.configs import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
K = 4


def windows(n, t, seed=0):
    return torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(seed))


def chain(seed=0, **kw):
    cfg = tiny_config(objective="pipeline-chunked", chunk_len=K, seq_len=24, **kw)
    obj = get_objective(cfg)
    torch.manual_seed(seed)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    for m in blocks:            # away from the init (zero offset embedding): every parameter matters
        for p in m.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
    return cfg, obj, blocks


def test_a_chunk_is_predicted_from_the_bytes_before_it_only_and_scored_exactly():
    cfg, obj, blocks = chain()
    hops = obj.local_hops(blocks)
    w = windows(3, cfg.seq_len)
    ctx = w[:, :-1]
    logits = obj._last_logits(hops, ctx)
    for c in range(cfg.seq_len // K):
        start = c * K
        later = ctx.clone()
        later[:, start + 1:] = (later[:, start + 1:] + 1 + torch.arange(cfg.seq_len - start - 1)) % 256
        got = obj._last_logits(hops, later)
        torch.testing.assert_close(got[:, :start + K], logits[:, :start + K])   # chunks <= c read no byte after c*k
        if start + K < cfg.seq_len:
            assert not torch.allclose(got[:, start + K:], logits[:, start + K:])   # later chunks do
        known = ctx.clone()
        known[:, start] = (known[:, start] + 1) % 256
        assert not torch.allclose(obj._last_logits(hops, known)[:, start:start + K], logits[:, start:start + K])
    res = obj.score(hops, w)
    want = float(F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1)))
    assert res.ce_kind == "exact" and res.ce == pytest.approx(want, rel=1e-6) and res.tokens == w[:, 1:].numel()


def test_its_clean_stream_is_the_pipeline_model_on_the_same_weights():
    cfg, obj, blocks = chain()
    pipe = get_objective(cfg.replace(objective="pipeline"))
    ctx = windows(2, cfg.seq_len)[:, :-1]
    h = hp = None
    for b, m in enumerate(blocks):
        h = obj.stage_forward(m, b, h, ctx if b == 0 else None)
        hp = pipe.stage_forward(m.inner, b, hp, ctx if b == 0 else None)
        assert h.shape == (2, cfg.seq_len, obj.state_dim()) == (2, cfg.seq_len, 2 * cfg.d_model)
        torch.testing.assert_close(h[..., :cfg.d_model], hp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 4, 10, 37])
def test_n_bytes_take_ceil_n_over_k_traversals_one_sweep_and_n_autoregressively(n):
    cfg, obj, blocks = chain()
    prompt = b"a prompt longer than the window of twenty-four bytes"   # history is cut to seq_len
    for mode, want in (("one_sweep", math.ceil(n / K)), ("autoregressive", n)):
        hops = [CountingHop(h) for h in obj.local_hops(blocks)]
        out = obj.generate(hops, prompt, n, mode)
        assert len(out) == n and [h.calls for h in hops] == [want] * cfg.n_blocks, (mode, [h.calls for h in hops])
    # one sweep's first chunk is the greedy argmax of the queries of a chunk starting at the prompt's last byte
    hops = obj.local_hops(blocks)
    ctx = torch.tensor([list(b"abcde") + [0] * (K - 1)])    # the chunk's queries at positions 4..7 (4 = k)
    first = obj.generate(hops, b"abcde", K, "one_sweep")
    assert list(first) == obj._last_logits(hops, ctx)[0, 4:4 + K].argmax(-1).tolist()
