"""Where blocks run: the device a command asks for, the device a module sits on, and the one
mixed-precision policy (bf16 autocast on CUDA, plain fp32 elsewhere)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU; ``cpu`` / ``cuda`` as asked (refused if absent)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or auto")
    return torch.device(name)


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def autocast(device: torch.device | str):
    """bf16 autocast on CUDA; plain fp32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
