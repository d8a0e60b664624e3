"""AdamW without ``torch.optim``: the same update and the same ``state_dict`` format, and no
``torch._dynamo`` import.

Why: every ``torch.optim.Optimizer`` imports ``torch._dynamo`` (and with it sympy) the first time
a parameter group is added or a step taken, 68 MB more RSS in every node process for a
compiler the node never uses (BENCHMARKS.md "Lean nodes (issue 15)").

The step is torch's single-tensor AdamW (``torch.optim.adamw``, no amsgrad, no maximize): decoupled
weight decay ``p *= 1 - lr * wd``, ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 v + (1 - beta2) g^2``,
``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``, with the step count kept as
a float32 tensor per parameter. ``state_dict()`` / ``load_state_dict()`` use torch's layout
(parameters by index in group order), so checkpoints written by either load into the other.
tests/test_optim.py checks both against ``torch.optim.AdamW``.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["AdamW"]

# what torch.optim.AdamW (2.x) records in each param group; kept so its load_state_dict accepts ours
_TORCH_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                         "differentiable": False, "fused": None, "decoupled_weight_decay": True}


class AdamW:
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"invalid AdamW settings: lr={lr}, eps={eps}, weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW betas {betas}")
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.param_groups: list[dict] = []
        for g in groups:
            self.param_groups.append({**self.defaults, **{k: v for k, v in g.items() if k != "params"},
                                      "params": list(g["params"])})
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for g in self.param_groups:
            lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                st = self.state.get(p)
                if st is None:
                    st = self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                st["step"] += 1
                step = float(st["step"].item())
                p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(grad, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (st["exp_avg_sq"].sqrt() / ((1 - beta2 ** step) ** 0.5)).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-step_size)

    # -- torch's state_dict layout --------------------------------------------------------------
    def state_dict(self) -> dict:
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**_TORCH_GROUP_DEFAULTS, **{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(st) for p, st in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        by_index: dict[int, torch.Tensor] = {}
        for mine, saved in zip(self.param_groups, groups):
            ids = saved.get("params", [])
            if len(ids) != len(mine["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size "
                                 "of optimizer's group")
            by_index.update(zip(ids, mine["params"]))
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for k, st in state_dict.get("state", {}).items():
            p = by_index.get(int(k))
            if p is None:
                raise ValueError(f"loaded optimizer state names parameter {k}, which this optimizer lacks")
            new = {}
            for name, v in st.items():
                if name == "step":
                    new[name] = torch.as_tensor(v, dtype=torch.float32).detach().clone().cpu()
                elif torch.is_tensor(v):
                    if v.shape != p.shape:
                        raise ValueError(f"optimizer state {name!r} of parameter {k} has shape {tuple(v.shape)}, "
                                         f"the parameter {tuple(p.shape)}")
                    new[name] = v.detach().to(device=p.device, dtype=p.dtype).clone()
                else:
                    new[name] = v
            state[p] = new
        for mine, saved in zip(self.param_groups, groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in saved:
                    mine[key] = tuple(saved[key]) if key == "betas" else saved[key]
        self.state = state
