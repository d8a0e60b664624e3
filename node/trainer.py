"""Trains ONE block on this worker: its module, its optimizer, its data stream, nothing else.

The trainer is the only code that writes its block's weights: optimizer steps, an accepted
averaging round (:meth:`apply_change`), a downloaded state (:meth:`load_state`), given weights
(:meth:`adopt_parameters`) and a resumed checkpoint all go through it, under ``self.lock`` (the training
loop, hop serving and averaging run in different threads).

Objectives that ``needs_upstream`` (forward-chained) train block b on the outputs of blocks < b:
the trainer then reads them from an :class:`~blocktrain.node.upstream.UpstreamSnapshots` and
cannot train or judge a round until it holds all of them (:meth:`ready`).

Chain-trained objectives (``pipeline``, ``forward-streamed``) do not step locally: the pipeline
engine (``node/pipeline``) runs the block's forward and backward under ``self.lock``, reports each
micro-batch whose gradients it accumulated (:meth:`add_microbatch`), and the trainer takes the
optimizer step on their mean (:meth:`step_accumulated`). ``weights_version`` counts every write
of the weights, so the engine knows when a stashed forward no longer matches them.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.chain import HopRequest, HopResult
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.windows import WindowSampler, eval_windows
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.train import LrSchedule, lr_at, make_optimizer, optimizer_step


class HoldTimedLock:
    """The trainer's re-entrant lock, remembering how long its last outermost holds took: a training
    step (or a pipeline forward or backward) runs under it, so a checkpoint asked for now may first
    wait about that long (the node's stop sizes its final checkpoint's budget by it)."""

    def __init__(self, keep: int = 32):
        self._lock = threading.RLock()
        self._depth = 0                 # changed only by the holding thread
        self._since = 0.0
        self._holds: deque[float] = deque(maxlen=keep)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self._depth += 1
            if self._depth == 1:
                self._since = time.monotonic()
        return ok

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._holds.append(time.monotonic() - self._since)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def longest_recent_hold(self) -> float:
        """Seconds of the longest of the last holds (the one in progress counted as far as it got)."""
        held = list(self._holds)
        if self._depth:   # a racy read of another thread's hold: good enough for a budget
            held.append(time.monotonic() - self._since)
        return max(held, default=0.0)


class UpstreamNotReady(RuntimeError):
    """Block b's objective needs snapshots of blocks < b that this worker has not fetched yet."""


class BlockTrainer:
    def __init__(self, cfg: ModelConfig, block_index: int, train_data, check_data, *,
                 device: torch.device | str = "cpu", seed: int = 0, worker_id: int = 0,
                 check_windows: int = 4, upstream=None, lr_decay_s: float | None = None, clock=time.monotonic):
        self.cfg, self.block_index = cfg, block_index
        if lr_decay_s is not None and not 0 < lr_decay_s < float("inf"):
            raise ValueError(f"lr_decay_s must be a positive number of seconds, got {lr_decay_s!r}")
        self.lr_decay_s = lr_decay_s  # None: warm-up then constant (open-ended); else cosine over these seconds
        self._clock = clock
        self._first_step_at: float | None = None
        self.last_lr: float | None = None   # the rate of the last optimizer step (status)
        self.device = torch.device(device)
        self.objective = get_objective(cfg)
        torch.manual_seed(cfg.init_seed + block_index)
        self.module = self.objective.build_block(block_index).to(self.device)
        self.opt = make_optimizer(self.module, cfg)
        self.sampler = WindowSampler(train_data, cfg.seq_len, seed=seed, worker_id=worker_id)
        self.gen = torch.Generator().manual_seed(seed * 7919 + worker_id)
        self._hop = self.objective.make_hop(self.module, block_index)
        self.check_windows = eval_windows(check_data, cfg.seq_len, check_windows).to(self.device)
        self.upstream = upstream      # UpstreamSnapshots of blocks < b, or None
        self.lock = HoldTimedLock()
        self.step = 0
        self.samples_seen = 0
        self.samples_since_average = 0
        self.losses: deque[tuple[float, int, float]] = deque(maxlen=500)   # (time, step, loss)
        self._rate: deque[tuple[float, int]] = deque(maxlen=50)
        self.weights_version = 0      # +1 on every write of the weights
        self.outside_writes = 0       # +1 on every write not made by an optimizer step (a round, a loaded state)
        self._pending: list[tuple[int, float | None]] = []   # accumulated micro-batches: (samples, loss)

    # -- readiness (forward-chained: snapshots of blocks < b) -------------------------------------
    def ready(self) -> bool:
        return self.upstream is None or self.upstream.ready()

    def not_ready_reason(self) -> str:
        return "waiting for snapshots of the upstream blocks (forward-chained)"

    def _upstream_arg(self) -> list[torch.nn.Module] | None:
        if self.upstream is None:
            return None
        mods = self.upstream.modules()
        if mods is None:
            raise UpstreamNotReady(f"block {self.block_index} has no snapshot yet of upstream block(s) "
                                   f"{', '.join(map(str, self.upstream.missing()))}")
        return mods

    # -- training -------------------------------------------------------------------------------
    def current_lr(self) -> float:
        """The learning rate of the step about to be taken. Warm-up then constant (a volunteer run is
        open-ended); with ``lr_decay_s`` (a budgeted run: benchmarks) warm-up then cosine to a tenth of
        the peak over that many seconds of this trainer's training, counted from its first step, and the
        tenth after that. The first call starts the clock."""
        if self.lr_decay_s is None:
            return lr_at(self.step, self.cfg)
        now = self._clock()
        if self._first_step_at is None:
            self._first_step_at = now
        progress = (now - self._first_step_at) / self.lr_decay_s
        return LrSchedule(self.cfg.lr, self.cfg.warmup_steps, "cosine").at(self.step, progress)

    def _step_lr(self) -> float:
        self.last_lr = self.current_lr()
        return self.last_lr

    def train_step(self) -> dict:
        up = self._upstream_arg()   # before drawing a batch: a worker waiting for upstream skips none
        w = self.sampler.next_batch(self.cfg.batch_size).to(self.device)
        with self.lock:
            stats = optimizer_step(self.module, self.opt, self.cfg, self.step,
                                   lambda: self.objective.local_loss(self.module, self.block_index, w, self.gen,
                                                                     upstream=up), lr=self._step_lr())
            self.step += 1
            self.weights_version += 1
            self.samples_seen += w.shape[0]
            self.samples_since_average += w.shape[0]
        now = time.time()
        self.losses.append((now, self.step, stats["loss"]))
        self._rate.append((now, self.samples_seen))
        return stats

    # -- chain training: gradients accumulated by the pipeline engine ---------------------------------
    @property
    def judges_by_loss(self) -> bool:
        """Can this block be judged by a held-out loss of its own (averaging, downloads)? Not for
        chain-trained objectives: a pipeline block has no loss alone."""
        return self.objective.block_local

    def add_microbatch(self, samples: int, loss: float | None) -> int:
        """Count one micro-batch whose gradients were just accumulated into the block's ``.grad``
        (call under ``self.lock``); returns how many are pending."""
        with self.lock:
            self._pending.append((samples, loss))
            return len(self._pending)

    @property
    def pending_microbatches(self) -> int:
        """Micro-batches whose gradients wait for the next :meth:`step_accumulated`."""
        return len(self._pending)

    def step_accumulated(self, *, apply: bool = True) -> dict | None:
        """One optimizer step on the mean gradient of the pending micro-batches (clip, step, zero);
        with ``apply`` False (not training: max steps reached, serve-only) they are dropped. None if
        nothing was pending."""
        with self.lock:
            pending, self._pending = self._pending, []
            if not pending:
                return None
            params = [p for p in self.module.parameters() if p.grad is not None]
            stats = None
            if apply:
                for p in params:
                    p.grad.div_(len(pending))
                lr = self._step_lr()
                for g in self.opt.param_groups:
                    g["lr"] = lr
                gnorm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip))
                if gnorm == gnorm and gnorm != float("inf"):   # a non-finite gradient is dropped, not applied
                    self.opt.step()
                    samples = sum(n for n, _ in pending)
                    self.step += 1
                    self.weights_version += 1
                    self.samples_seen += samples
                    self.samples_since_average += samples
                    losses = [x for _, x in pending if x is not None]
                    stats = {"loss": sum(losses) / len(losses) if losses else None, "grad_norm": gnorm,
                             "microbatches": len(pending)}
            self.opt.zero_grad(set_to_none=True)
        if stats is not None:
            now = time.time()
            if stats["loss"] is not None:
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

    def check_loss_of(self, tensors: Sequence[torch.Tensor]) -> float:
        """The check loss of this block with ``tensors`` as its parameters (in ``parameters()`` order).
        The probe block is built on the meta device and takes ``tensors`` themselves as its
        parameters where they fit (this device and dtype), so its own initial weights never take
        memory; its buffers (constant tables) are copied from the live block."""
        with torch.device("meta"):
            probe = self.objective.build_block(self.block_index)
        probe = probe.to_empty(device=self.device)
        with torch.no_grad():
            with self.lock:
                live = dict(self.module.named_buffers())
                for name, b in probe.named_buffers():
                    b.copy_(live[name])
            for p, x in zip(probe.parameters(), tensors):
                p.data = x if (x.device == p.device and x.dtype == p.dtype) else x.to(p.device, p.dtype)
        return self.check_loss(probe)

    # -- weights: the one writer ----------------------------------------------------------------
    def parameters_snapshot(self) -> list[torch.Tensor]:
        with self.lock:
            return [p.detach().to("cpu").clone() for p in self.module.parameters()]

    def parameters_for_round(self, into: Sequence[torch.Tensor]) -> tuple[float, int]:
        """Copy the live weights into ``into`` (the averager's buffers: no copy of ours) and return
        the round's averaging weight (samples since the last round) and step, all read together."""
        with self.lock:
            with torch.no_grad():
                for dst, p in zip(into, self.module.parameters()):
                    dst.copy_(p.detach())
            return float(max(1, self.samples_since_average)), self.step

    def apply_change(self, change: Sequence[torch.Tensor], *, complete: bool = True) -> None:
        """Add an accepted round's change (group mean - the weights we sent) to the live weights,
        keeping the steps taken while the round ran. ``complete``: every member's part was averaged, so the
        samples trained since the last round are now in the group's weights and the next round's averaging
        weight starts again from 0; after a round some member stalled (parts of the block kept as they were,
        or nobody's but ours averaged) the weight is kept."""
        with self.lock:
            with torch.no_grad():
                for p, c in zip(self.module.parameters(), change):
                    p.add_(c.to(p.device, p.dtype))
            if complete:
                self.samples_since_average = 0
            self.weights_version += 1
            self.outside_writes += 1

    def adopt_parameters(self, tensors: Sequence[torch.Tensor], *, step: int, samples_seen: int) -> None:
        """Replace the weights by ``tensors`` (in ``parameters()`` order), and the counters."""
        with self.lock:
            for p, t in zip(self.module.parameters(), tensors):
                p.data.copy_(t.to(p.device, p.dtype))
            self.step, self.samples_seen = step, samples_seen
            self.weights_version += 1
            self.outside_writes += 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}

    def load_state(self, tensors: dict[str, torch.Tensor], *, step: int, samples_seen: int) -> None:
        """Replace the weights by a named state dict (strict: missing, extra or misshapen refused)."""
        with self.lock:
            self.module.load_state_dict({k: v.to(self.device) for k, v in tensors.items()})
            self.step, self.samples_seen = step, samples_seen
            self.weights_version += 1
            self.outside_writes += 1

    def shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """What averaging peers download from us: metadata and the parameters."""
        with self.lock:
            meta = {"step": self.step, "samples_seen": self.samples_seen, "config_hash": self.cfg.config_hash,
                    "block_index": self.block_index}
            return meta, self.parameters_snapshot()

    def served_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What the block-state RPC serves (late joiners, upstream snapshots, export)."""
        with self.lock:
            meta = {"step": self.step, "samples_seen": self.samples_seen, "config_hash": self.cfg.config_hash}
            return meta, self.state_tensors()

    # -- serving --------------------------------------------------------------------------------
    def hop(self, req: HopRequest) -> HopResult:
        with self.lock:   # the hop runs the module in eval mode and restores its mode
            return self._hop(req)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write this block's checkpoint under the trainer's lock, from the live tensors: the weights, the
        AdamW state and the counters of one moment (no step can move the moments while they stream to
        disk), and no copy of the weights (on CPU). Steps, hops and averaging wait for it meanwhile (a
        d_model-768 block of 21M parameters: BENCHMARKS.md "Memory of a pipeline block", session 21)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with self.lock:
            ckpt.save_config(directory, self.cfg)
            return ckpt.save_block(directory / ckpt.block_filename(self.block_index), self.module.state_dict(),
                                   config=self.cfg, block_index=self.block_index, step=self.step,
                                   samples_seen=self.samples_seen,
                                   optimizer_state={"optimizer": self.opt.state_dict(),
                                                    "sampler": self.sampler.state_dict()})

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
            self.weights_version += 1
            self.outside_writes += 1
        return True
