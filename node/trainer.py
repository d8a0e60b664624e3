"""Trains ONE block on this worker: its module, its optimizer, its data stream, nothing else.

The trainer is shared by three threads (training loop, hop serving, averaging), so every read or
write of the weights goes through ``self.lock``.

Objectives that ``needs_upstream`` (forward-chained) train block b on the outputs of blocks < b:
the trainer then also keeps read-only snapshots of those blocks (``set_upstream``), which the node
refreshes from their holders; it cannot train or judge a round until it has all of them.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import torch

from ..blocks import checkpoint as ckpt
from ..blocks.chain import HopRequest, HopResult
from ..blocks.config import ModelConfig
from ..blocks.windows import WindowSampler, eval_windows
from ..blocks.objectives import get_objective
from ..blocks.train import make_optimizer, optimizer_step


class UpstreamNotReady(RuntimeError):
    """Block b's objective needs snapshots of blocks < b that this worker has not fetched yet."""


class BlockTrainer:
    def __init__(self, cfg: ModelConfig, block_index: int, train_data, check_data, *,
                 device: torch.device | str = "cpu", seed: int = 0, worker_id: int = 0,
                 check_windows: int = 4):
        self.cfg, self.block_index = cfg, block_index
        self.device = torch.device(device)
        self.objective = get_objective(cfg)
        torch.manual_seed(cfg.init_seed + block_index)
        self.module = self.objective.build_block(block_index).to(self.device)
        self.opt = make_optimizer(self.module, cfg)
        self.sampler = WindowSampler(train_data, cfg.seq_len, seed=seed, worker_id=worker_id)
        self.gen = torch.Generator().manual_seed(seed * 7919 + worker_id)
        self._hop = self.objective.make_hop(self.module, block_index)
        self.check_windows = eval_windows(check_data, cfg.seq_len, check_windows).to(self.device)
        self.lock = threading.RLock()
        self.step = 0
        self.samples_seen = 0
        self.samples_since_average = 0
        self.losses: deque[tuple[float, int, float]] = deque(maxlen=500)   # (time, step, loss)
        self._rate: deque[tuple[float, int]] = deque(maxlen=50)
        n_up = block_index if self.objective.needs_upstream else 0
        self.upstream: list[torch.nn.Module | None] = [None] * n_up
        self.upstream_meta: list[dict | None] = [None] * n_up

    # -- upstream snapshots (forward-chained) ---------------------------------------------------
    def upstream_ready(self) -> bool:
        return all(m is not None for m in self.upstream)

    def set_upstream(self, j: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Install a read-only snapshot of block j < this block; refuses wrong or non-finite state
        (and then keeps the previous snapshot)."""
        if not 0 <= j < len(self.upstream):
            raise ValueError(f"block {self.block_index} keeps no snapshot of block {j}")
        if not all(bool(torch.isfinite(v).all()) for v in tensors.values()):
            raise ValueError(f"the offered state of block {j} is not finite")
        m = self.objective.build_block(j)
        m.load_state_dict(tensors)   # refuses missing, unexpected or misshapen tensors
        m = m.to(self.device).requires_grad_(False).eval()
        with self.lock:
            self.upstream[j] = m
            self.upstream_meta[j] = {**meta, "fetched_at": time.time()}

    def _upstream_arg(self) -> list[torch.nn.Module] | None:
        if not self.objective.needs_upstream:
            return None
        if not self.upstream_ready():
            missing = [j for j, m in enumerate(self.upstream) if m is None]
            raise UpstreamNotReady(f"block {self.block_index} has no snapshot yet of upstream block(s) "
                                   f"{', '.join(map(str, missing))}")
        return list(self.upstream)

    # -- training -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        up = self._upstream_arg()   # before drawing a batch: a worker waiting for upstream skips none
        w = self.sampler.next_batch(self.cfg.batch_size).to(self.device)
        with self.lock:
            stats = optimizer_step(self.module, self.opt, self.cfg, self.step,
                                   lambda: self.objective.local_loss(self.module, self.block_index, w, self.gen,
                                                                     upstream=up))
            self.step += 1
            self.samples_seen += w.shape[0]
            self.samples_since_average += w.shape[0]
        now = time.time()
        self.losses.append((now, self.step, stats["loss"]))
        self._rate.append((now, self.samples_seen))
        return stats

    def throughput(self) -> float:
        """Samples per second over the recent window of steps."""
        if len(self._rate) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
        return (s1 - s0) / max(t1 - t0, 1e-9)

    def recent_loss(self) -> float | None:
        if not self.losses:
            return None
        tail = list(self.losses)[-20:]
        return sum(x[2] for x in tail) / len(tail)

    @torch.no_grad()
    def check_loss(self, module: torch.nn.Module | None = None) -> float:
        """Local loss on a few fixed held-out windows with fixed noise: the averaging sanity check."""
        m = module if module is not None else self.module
        up = self._upstream_arg()
        was = m.training
        m.eval()
        g = torch.Generator().manual_seed(12345)
        loss, _ = self.objective.local_loss(m, self.block_index, self.check_windows, g, upstream=up)
        m.train(was)
        return float(loss)

    # -- weights --------------------------------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters()]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor], *, step: int | None = None,
                     samples_seen: int | None = None) -> None:
        with self.lock:
            self.module.load_state_dict({k: v.to(self.device) for k, v in tensors.items()})
            if step is not None:
                self.step = step
            if samples_seen is not None:
                self.samples_seen = samples_seen

    # -- serving --------------------------------------------------------------------------------
    def hop(self, req: HopRequest) -> HopResult:
        with self.lock:   # the hop runs the module in eval mode and restores its mode
            return self._hop(req)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with self.lock:
            state = {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}
            opt_state = {"optimizer": self.opt.state_dict(), "sampler": self.sampler.state_dict()}
            step, samples = self.step, self.samples_seen
        ckpt.save_config(directory, self.cfg)
        return ckpt.save_block(directory / ckpt.block_filename(self.block_index), state, config=self.cfg,
                               block_index=self.block_index, step=step, samples_seen=samples,
                               optimizer_state=opt_state)

    def resume(self, directory: str | Path) -> bool:
        """Load this block's checkpoint from ``directory`` if there is one; True if resumed."""
        path = Path(directory) / ckpt.block_filename(self.block_index)
        if not path.exists():
            return False
        c = ckpt.load_block(path, expected_config_hash=self.cfg.config_hash, expected_block=self.block_index,
                            map_location=str(self.device))
        with self.lock:
            self.module.load_state_dict(c.tensors)
            if c.optimizer_state:
                self.opt.load_state_dict(c.optimizer_state["optimizer"])
                self.sampler.load_state_dict(c.optimizer_state["sampler"])
            self.step, self.samples_seen = c.step, c.samples_seen
        return True
