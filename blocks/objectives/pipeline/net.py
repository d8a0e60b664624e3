"""One ``pipeline`` block: a slice of the end-to-end model (``reference.ReferenceLM``).

Block 0 holds the byte and position embeddings and layers 0..L-1 (L = ``layers_per_block``), block b
layers b*L..(b+1)*L-1, and the last block also the final norm and the next-byte head. The names
inside a block are ReferenceLM's (``byte_emb``, ``layers.i``, ``norm_out``, ``head``) with layer
indices local to the block, so :func:`to_reference` / :func:`from_reference` map a stack of blocks
to one ReferenceLM of ``n_blocks * layers_per_block`` layers and back.

Initialisation is ReferenceLM's, exactly: :func:`build_pipeline_block` replays the random draws of
``torch.manual_seed(cfg.init_seed); ReferenceLM(cfg)`` (each module's default init in construction
order, then ``init_weights``'s normal draws in module order) and keeps only block b's parameters,
building one foreign module at a time, so a worker never holds more than its block plus one layer.
The global RNG is left as it was.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ...config import ModelConfig
from ...layers import TransformerLayer, init_weights, residual_stream
from ...reference import ReferenceLM


class PipelineBlock(nn.Module):
    """``first``: embeds the bytes; ``last``: ends with the final norm and the head."""

    def __init__(self, cfg: ModelConfig, b: int, modules: dict[str, nn.Module] | None = None):
        super().__init__()
        self.first, self.last = b == 0, b == cfg.n_blocks - 1
        m = modules if modules is not None else _fresh_parts(cfg, b)
        if self.first:
            self.byte_emb, self.pos_emb = m["byte_emb"], m["pos_emb"]
        self.layers = nn.ModuleList(m["layers"])
        if self.last:
            self.norm_out, self.head = m["norm_out"], m["head"]

    def stream(self, h: torch.Tensor | None, context: torch.Tensor | None) -> torch.Tensor:
        """The block's output state from the state before it (block 0: from the bytes ``context``)."""
        return residual_stream(self, h, context, embed=self.first)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if not self.last:
            raise ValueError("only the last pipeline block has a next-byte head")
        return self.head(self.norm_out(h))


def _parts_in_order(cfg: ModelConfig) -> list[tuple[str, int, Callable[[], nn.Module]]]:
    """ReferenceLM's modules in construction (= registration) order: (name, owning block, factory)."""
    d, last, per = cfg.d_model, cfg.n_blocks - 1, cfg.layers_per_block
    parts: list[tuple[str, int, Callable[[], nn.Module]]] = [
        ("byte_emb", 0, lambda: nn.Embedding(cfg.vocab_size, d)),
        ("pos_emb", 0, lambda: nn.Embedding(cfg.seq_len, d))]
    parts += [("layers", i // per, lambda: TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, cfg.dropout))
              for i in range(cfg.reference_layers)]
    parts += [("norm_out", last, lambda: nn.LayerNorm(d)), ("head", last, lambda: nn.Linear(d, cfg.vocab_size))]
    return parts


def _fresh_parts(cfg: ModelConfig, b: int) -> dict[str, nn.Module]:
    kept: dict[str, nn.Module] = {"layers": []}
    for name, owner, make in _parts_in_order(cfg):
        if owner == b:
            if name == "layers":
                kept["layers"].append(make())
            else:
                kept[name] = make()
    return kept


def build_pipeline_block(cfg: ModelConfig, b: int) -> PipelineBlock:
    """Block b with exactly the weights ReferenceLM(cfg) gets after ``torch.manual_seed(cfg.init_seed)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        kept: dict[str, nn.Module] = {"layers": []}
        foreign: list[list[torch.Size]] = []   # shapes init_weights draws for, per part (in order)
        order: list[nn.Module | int] = []
        for name, owner, make in _parts_in_order(cfg):   # 1) default inits, in construction order
            module = make()
            if owner == b:
                if name == "layers":
                    kept["layers"].append(module)
                else:
                    kept[name] = module
                order.append(module)
            else:
                order.append(len(foreign))
                foreign.append([m.weight.shape for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding))])
            del module
        for item in order:                                 # 2) init_weights's draws, in module order
            if isinstance(item, nn.Module):
                init_weights(item)
            else:
                for shape in foreign[item]:
                    torch.empty(shape).normal_(std=0.02)
        return PipelineBlock(cfg, b, kept)


def to_reference(cfg: ModelConfig, blocks: Sequence[PipelineBlock]) -> ReferenceLM:
    """The stack of blocks as one ReferenceLM of ``n_blocks * layers_per_block`` layers (copies)."""
    ref = ReferenceLM(cfg, n_layers=cfg.reference_layers)
    ref.load_state_dict(reference_state(cfg, [m.state_dict() for m in blocks]))
    return ref


def reference_state(cfg: ModelConfig, states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Block state dicts -> one ReferenceLM state dict (layer indices made global)."""
    out: dict[str, torch.Tensor] = {}
    for b, sd in enumerate(states):
        for k, v in sd.items():
            if k.startswith("layers."):
                i, rest = k.split(".", 2)[1:]
                k = f"layers.{b * cfg.layers_per_block + int(i)}.{rest}"
            out[k] = v
    return out


def from_reference(cfg: ModelConfig, ref: ReferenceLM) -> list[PipelineBlock]:
    """A ReferenceLM of ``n_blocks * layers_per_block`` layers cut into blocks (copies)."""
    per, sd = cfg.layers_per_block, ref.state_dict()
    blocks = []
    for b in range(cfg.n_blocks):
        m = PipelineBlock(cfg, b)
        own = {}
        for k in m.state_dict():
            if k.startswith("layers."):
                i, rest = k.split(".", 2)[1:]
                own[k] = sd[f"layers.{b * per + int(i)}.{rest}"]
            else:
                own[k] = sd[k]
        m.load_state_dict(own)
        blocks.append(m)
    return blocks
