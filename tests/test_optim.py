"""blocks/optim.py: blocktrain's AdamW is torch's AdamW (same numbers, same state_dict), without
importing torch._dynamo (issue 15, lean nodes)."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.optim import AdamW
from blocktrain.blocks.train import make_optimizer, optimizer_step

from test_utils.configs import tiny_config


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _groups(m: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _train(m, opt, steps: int, start: int = 0) -> None:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(start))
    for i in range(start, start + steps):
        for g in opt.param_groups:   # the trainer's warm-up changes lr every step
            g["lr"] = 0.01 * (i + 1) / (start + steps)
        opt.zero_grad(set_to_none=True)
        m(x).pow(2).mean().backward()
        opt.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_steps_are_torch_adamw_bit_for_bit():
    a, b = _model(), _model()
    _train(a, torch.optim.AdamW(_groups(a), lr=0.01, betas=(0.9, 0.95)), 20)
    _train(b, AdamW(_groups(b), lr=0.01, betas=(0.9, 0.95)), 20)
    assert _same(a, b)
    assert not _same(a, _model())   # the steps did move the weights


@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_state_dicts_load_into_each_other_and_training_goes_on_identically(direction):
    src_cls, dst_cls = (torch.optim.AdamW, AdamW) if direction == "torch->ours" else (AdamW, torch.optim.AdamW)
    a = _model()
    oa = src_cls(_groups(a), lr=0.01, betas=(0.9, 0.95))
    _train(a, oa, 5)
    b = _model()
    b.load_state_dict(a.state_dict())
    ob = dst_cls(_groups(b), lr=0.01, betas=(0.9, 0.95))
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))   # as through a checkpoint file: torch's load keeps references
    _train(a, oa, 5, start=5)
    _train(b, ob, 5, start=5)
    assert _same(a, b)


def test_a_mismatched_state_dict_is_refused_and_changes_nothing():
    a = _model()
    oa = AdamW(_groups(a), lr=0.01)
    _train(a, oa, 2)
    saved = oa.state_dict()
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in saved["state"].items()}
    with pytest.raises(ValueError, match="different number"):   # one group where there are two
        oa.load_state_dict({"state": {}, "param_groups": saved["param_groups"][:1]})
    wrong = {**saved["state"], 0: {**saved["state"][0], "exp_avg": torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match="has shape"):
        oa.load_state_dict({"state": wrong, "param_groups": saved["param_groups"]})
    now = oa.state_dict()["state"]
    assert all(torch.equal(v, now[i][k]) for i, st in before.items() for k, v in st.items())


def test_a_node_step_does_not_import_torch_dynamo():
    code = ("import sys, torch\n"
            "from blocktrain.blocks.objectives import get_objective\n"
            "from blocktrain.blocks.train import make_optimizer, optimizer_step\n"
            "from blocktrain.blocks.config import ModelConfig\n"
            "cfg = ModelConfig(d_model=32, n_heads=2, layers_per_block=1, n_blocks=2, seq_len=16, target_dim=8,"
            " batch_size=2, warmup_steps=0)\n"
            "obj = get_objective(cfg); m = obj.build_block(0); opt = make_optimizer(m, cfg)\n"
            "w = torch.randint(0, 256, (2, 17)); g = torch.Generator().manual_seed(0)\n"
            "optimizer_step(m, opt, cfg, 0, lambda: obj.local_loss(m, 0, w, g))\n"
            "opt.state_dict(); opt.load_state_dict(opt.state_dict())\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_make_optimizer_trains_a_block_like_torch_adamw(monkeypatch):
    cfg = tiny_config()
    results = []
    for torch_optim in ("0", "1"):
        monkeypatch.setenv("BT_TORCH_OPTIM", torch_optim)
        obj = get_objective(cfg)
        torch.manual_seed(cfg.init_seed)
        m = obj.build_block(0)
        opt = make_optimizer(m, cfg)
        assert isinstance(opt, torch.optim.AdamW if torch_optim == "1" else AdamW)
        w = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            optimizer_step(m, opt, cfg, step, lambda: obj.local_loss(m, 0, w, g))
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results))
