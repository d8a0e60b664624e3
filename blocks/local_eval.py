"""Score saved checkpoints (``bt-node eval``) the same way ``train-local`` scores fresh ones."""
from __future__ import annotations

from pathlib import Path

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.data import DataSplit, eval_windows
from blocktrain.blocks.evaluate import evaluate_blocks, evaluate_reference
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.reference import ReferenceLM


def load_blocks(directory: str | Path, device: torch.device):
    cfg, saved = ckpt.load_checkpoint_dir(directory)
    objective = get_objective(cfg)
    blocks = []
    for b in range(cfg.n_blocks):
        m = objective.build_block(b)
        m.load_state_dict(saved[b].tensors)
        blocks.append(m.to(device))
    return cfg, objective, blocks


def evaluate_checkpoint_dir(directory: str | Path, split: DataSplit, *, device: torch.device,
                            k: int = 4, n_windows: int = 64) -> dict:
    cfg, objective, blocks = load_blocks(directory, device)
    windows = eval_windows(split.eval, cfg.seq_len, n_windows)
    res = evaluate_blocks(objective, blocks, windows, k=k)
    ref_path = Path(directory) / "reference.safetensors"
    if ref_path.exists():
        ref = ReferenceLM(cfg)
        ref.load_state_dict(ckpt.load_reference(ref_path, expected_config_hash=cfg.config_hash).tensors)
        res["reference_ce"] = evaluate_reference(ref.to(device), windows)
    res.update(objective=cfg.objective, protocol=split.protocol, data=split.description,
               checkpoint=str(directory), config_hash=cfg.config_hash, eval_windows=int(windows.shape[0]))
    return res
