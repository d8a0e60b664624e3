"""Issue 13's chain-trained objectives, in one process (no network): ``pipeline`` is exactly the
end-to-end ReferenceLM cut into blocks (same modules, same initial weights, same loss and
gradients), refuses block-local training, and trains in LocalRun; ``forward-streamed`` trains each
block on its detached input with its own head."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from blocktrain.blocks.chain_train import chain_gradients
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.local_run import LocalRun
from blocktrain.blocks.model import load
from blocktrain.blocks.objectives import NotBlockLocalError, get_objective
from blocktrain.blocks.objectives.pipeline import from_reference, to_reference
from blocktrain.blocks.reference import ReferenceLM

from test_utils.configs import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def windows(n, t, seed=0):
    return torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(seed))


def text_split():
    data = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)
    return DataSplit(data, data, "test", "in-memory")


@pytest.mark.parametrize("shape", [dict(n_blocks=3, layers_per_block=2, init_seed=7),
                                   dict(n_blocks=4, layers_per_block=1, init_seed=0)])
def test_pipeline_blocks_stack_into_the_reference_model_with_its_initial_weights(shape):
    cfg = tiny_config(objective="pipeline", **shape)
    obj = get_objective(cfg)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    assert torch.equal(torch.get_rng_state(), before)          # building a block leaves the global RNG alone
    torch.manual_seed(cfg.init_seed)
    ref = ReferenceLM(cfg)                                      # the whole-size end-to-end model
    got, want = to_reference(cfg, blocks).state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [m.first for m in blocks] == [True] + [False] * (cfg.n_blocks - 1)
    assert not hasattr(blocks[1], "head") and hasattr(blocks[-1], "head") and not hasattr(blocks[1], "byte_emb")
    back = from_reference(cfg, ref)
    assert all(torch.equal(p, q) for m, n in zip(back, blocks) for p, q in zip(m.parameters(), n.parameters()))


def test_pipeline_chain_has_the_reference_loss_gradients_and_exact_score():
    cfg = tiny_config(objective="pipeline", n_blocks=3, layers_per_block=2)
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    ref = to_reference(cfg, blocks)
    w = windows(4, cfg.seq_len)
    got = chain_gradients(obj, blocks, w)
    # the reference, with the residual stream kept at each block boundary
    ref.train()
    ctx = w[:, :-1]
    h = ref.byte_emb(ctx) + ref.pos_emb(torch.arange(ctx.shape[1]))
    cuts = []
    for i, layer in enumerate(ref.layers):
        h = layer(h)
        if (i + 1) % cfg.layers_per_block == 0 and i + 1 < len(ref.layers):
            h.retain_grad()
            cuts.append(h)
    loss = torch.nn.functional.cross_entropy(ref.head(ref.norm_out(h)).reshape(-1, 256), w[:, 1:].reshape(-1))
    loss.backward()
    assert got.losses == {2: pytest.approx(float(loss.detach()), abs=1e-6)}
    assert len(got.boundary_grads) == 2
    for mine, theirs in zip(got.boundary_grads, cuts):
        torch.testing.assert_close(mine, theirs.grad, rtol=1e-5, atol=1e-8)
    # the blocks' parameters, concatenated in order, are the reference's parameters in its order
    names = [n for n, _ in ref.named_parameters()]
    flat = [p.grad for m in blocks for p in m.parameters()]
    assert len(flat) == len(names)
    for n, g in zip(names, flat):
        torch.testing.assert_close(g, dict(ref.named_parameters())[n].grad, rtol=1e-5, atol=1e-8, msg=n)
    res = obj.score(obj.local_hops(blocks), w)
    with torch.no_grad():
        assert res.ce_kind == "exact" and res.ce == pytest.approx(ref.eval().score(w), abs=1e-5)


def test_a_pipeline_block_refuses_to_train_alone_but_a_one_block_model_does():
    cfg = tiny_config(objective="pipeline")
    obj = get_objective(cfg)
    with pytest.raises(NotBlockLocalError, match="cannot train alone"):
        obj.local_loss(obj.build_block(1), 1, windows(2, cfg.seq_len))
    assert not obj.block_local and obj.chain_training == "backprop"
    assert obj.stage_has_loss(cfg.n_blocks - 1) and not obj.stage_has_loss(0)
    assert math.isnan(obj.block_alone_ce(obj.build_block(0), 0, windows(2, cfg.seq_len)))
    one = get_objective(tiny_config(objective="pipeline", n_blocks=1))
    loss, stats = one.local_loss(one.build_block(0), 0, windows(2, cfg.seq_len))
    assert loss.requires_grad and stats["ce"] == pytest.approx(math.log(256), abs=0.05)


def test_forward_streamed_trains_each_block_on_its_detached_input_with_its_own_head():
    cfg = tiny_config(objective="forward-streamed")
    obj = get_objective(cfg)
    assert obj.chain_training == "streamed" and not obj.needs_upstream and obj.upstream_blocks(2) == 0
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    w = windows(4, cfg.seq_len, seed=3)
    got = chain_gradients(obj, blocks, w)
    assert sorted(got.losses) == [0, 1, 2] and got.boundary_grads == [None, None]
    # block 1's gradient is its own loss's on block 0's output: forward-chained's local loss with live upstream
    g1 = [p.grad.clone() for p in blocks[1].parameters()]
    for p in blocks[1].parameters():
        p.grad = None
    loss1, _ = obj.local_loss(blocks[1], 1, w, upstream=blocks[:1])
    assert float(loss1.detach()) == pytest.approx(got.losses[1], abs=1e-6)
    loss1.backward()
    for a, p in zip(g1, blocks[1].parameters()):
        torch.testing.assert_close(a, p.grad)
    # block 0's gradient comes from its own head only: later losses send nothing back
    g0 = [p.grad.clone() for p in blocks[0].parameters()]
    for p in blocks[0].parameters():
        p.grad = None
    obj.local_loss(blocks[0], 0, w, upstream=[])[0].backward()
    for a, p in zip(g0, blocks[0].parameters()):
        torch.testing.assert_close(a, p.grad)


# pipeline-chunked: 5.56 -> 2.34 in 40 rounds; with only its head trained (no gradient into the
# blocks) 3.94, so its bar is 2.5. It emits k = 4 bytes per traversal.
@pytest.mark.parametrize("objective, drop, traversals", [("pipeline", 1.0, 6), ("forward-streamed", 1.0, 6),
                                                        ("pipeline-chunked", 2.5, 2)])
def test_local_run_trains_a_chain_objective_and_its_checkpoint_loads(tmp_path, objective, drop, traversals):
    cfg = tiny_config(objective=objective, lr=3e-3, chunk_len=4)
    run = LocalRun(cfg, text_split(), torch.device("cpu"), reference=False)
    first = run.evaluate(n_windows=8)["chain_ce"]
    for _ in range(40):
        run.round()
    res = run.evaluate(n_windows=8)
    assert res["chain_ce"] < first - drop, (first, res["chain_ce"])
    assert [tr.steps for tr in run.trainees] == [40] * cfg.n_blocks
    run.save(tmp_path / "ck")
    model = load(tmp_path / "ck", device="cpu")
    w = torch.tensor([list(b"the cat sat on the mat; the dog sat on the log. ")[:cfg.seq_len + 1]])
    assert model.score(bytes(w[0].tolist())) == pytest.approx(
        run.objective.score(run.objective.local_hops(run.blocks), w).ce, abs=1e-5)
    out = model.generate("the cat ", max_bytes=6)
    assert out["bytes_generated"] == 6 and out["traversals"] == traversals
