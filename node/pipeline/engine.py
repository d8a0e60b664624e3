"""The pipeline engine: training along the chain of holders (issue 13; SWARM-style, one block per worker).

For runs whose objective is chain-trained (``pipeline``: backprop through the chain;
``forward-streamed``: forward traffic only) this replaces the node's local training steps.

* A holder of block 0 reads its own data split and keeps up to ``inflight`` micro-batches in flight:
  it runs block 0 on one (with gradients), sends h_0 to a holder of block 1 (``NextStage``:
  stochastic wiring on its own measurements) and, in backprop mode, runs its backward on the
  gradient that comes back.
* A holder of block b > 0 serves ``rpc_train`` (:meth:`handle`): it runs its block on the h_{b-1} it
  receives, calls a holder of block b+1 with h_b, and on the answer dL/dh_b runs its backward and
  answers dL/dh_{b-1}; the route back is the route forward. The last block computes the loss and
  answers at once. In streamed mode every block computes its own head's loss on its output, steps
  on it, and the answers carry no gradient.
* Each holder accumulates its block's gradients; every ``accumulate`` micro-batches the trainer (the
  only writer of the weights) takes one optimizer step on their mean. Same-block replicas keep
  averaging as before (the node's averaging loop, woken every ``average_every`` steps).
* With ``flush`` (GPipe) a block-0 holder sends windows of ``inflight`` micro-batches, each window
  finished (or lost) before the next, and marks every micro-batch with its window (``window`` on the
  wire, with ``origin``). Steps then follow the windows, not counts: block 0 steps when its window is
  done; a stage steps when the first micro-batch of another (origin, window) arrives, before its
  forward, and only if it holds no graph awaiting a backward (else the step waits for the next
  window change: windows merge rather than a kept graph going stale; after ``MAX_DEFERRED`` such
  waits in a row it steps anyway, counted ``window_steps_forced``). So a failed, retried or extra
  micro-batch no longer shifts a holder's step phase (run 15's defect, BENCHMARKS.md), and with one
  holder per block no backward recomputes. Micro-batches without a window (a block-0 holder that does
  not flush) keep the ``accumulate`` count among themselves.

Compute runs in one thread per worker, under the trainer's lock; network waits never hold it. A
forward's graph is kept until its backward. When the weights changed meanwhile (an optimizer step
or an accepted averaging round: ``trainer.weights_version``) that graph is invalid (the optimizer
wrote the weights in place), and the backward recomputes the forward from the stashed input first
(hivemind ``ModuleBackend``-style). With ``weight_stash`` (off by default: measured no better at
equal tokens, BENCHMARKS.md "Training along the chain") it recomputes it with the
weights the forward used (PipeDream's weight stashing): the engine keeps one copy of the weights per
version that a held micro-batch still needs, so the gradient dL/dh_b that came back (computed
downstream on the h_b this stage sent) is backpropagated through the function that produced that
h_b, and the parameter gradient is added to the block's live gradients. Without it the recompute
uses the current weights: the gradient is then that of a different h_b than the one sent. Both are
delayed gradients; the default (``inflight`` 1) has none.
With ``recompute`` (GPipe's re-materialisation, off by default) a held micro-batch keeps no graph at
all: its forward runs without one and keeps only its input (h_{b-1}, or block 0's bytes) and the random
state it started from; its output goes to the wire and is not kept (a retry after a failed call runs the
forward again, the same bits: ``resent_recomputed``); its backward runs the forward again from them with
a graph (the same dropout masks) and backpropagates at once. A holder then keeps at most one graph
however many micro-batches it holds, for one more forward of the block per micro-batch; the gradients
are those of the kept graph.
With ``layer_checkpoint`` (activation checkpointing per layer, off by default; ``blocks.layers.layer_checkpointing``)
every forward here that records a graph (a kept graph, the recompute before a backward, the last block's or
a streamed block's forward) keeps only each layer's input, and the backward runs each layer again: the
activation memory of one layer at a time instead of the block's, for one more forward of the block per
micro-batch; the same gradients to float tolerance. Without ``recompute`` a held micro-batch then keeps
its layers' inputs (and its output) instead of its whole graph, at the compute ``recompute`` alone costs;
with it, only its input, the recompute before its backward keeping no more than the layers' inputs.
Memory: a stage holds at most ``max_stash`` micro-batches between forward and backward and answers
``busy`` beyond that; a block-0 holder at most ``inflight``; weight copies at most one per held
micro-batch (shared by those of one version; :meth:`stash_bytes` reports them); a stage that screens losses
(the last block, every block but 0 when streamed: node/pipeline/screen.py) also keeps the input and targets of the
last micro-batch it trained on, to follow outside writes of its weights. Faults: every call
carries what is left of the micro-batch's budget (``timeout_s`` at first, then adapted to the round
trips block 0 measures, up to ``timeout_max_s``: :mod:`~blocktrain.node.pipeline.budget`); a stage
whose compute thread frees up only after that deadline does not run the forward (``expired_in_queue``,
answered ``timeout``: nobody waits for it any more); a holder that dies or stalls costs the
micro-batches it held: its caller tries another holder (``retries``) or gives up, and the block-0
holder counts the micro-batch lost. Nothing waits unbounded. Dropout > 0 with a recompute after a
weight change draws new masks (as hivemind's recomputing backward does), unless ``recompute`` is on
(it keeps the random state for every held micro-batch).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import copy
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from blocktrain.blocks.chain_train import stage_backward
from blocktrain.blocks.layers import layer_checkpointing
from blocktrain.blocks.rng import rng_restored, rng_state
from blocktrain.node.loops import DutyCycle
from blocktrain.node.pipeline.budget import MicrobatchBudget
from blocktrain.node.pipeline.screen import LossScreen
from blocktrain.node.pipeline.verify import CheckInconclusive, GradientCheck
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.pipeline.stats import PipelineStats
from blocktrain.node.routing.pipeline_route import DownstreamFailed, NextStage, StateSource
from blocktrain.node.trainer import BlockTrainer
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.errors import HopRequestError, drop_tracebacks
from blocktrain.p2p.pipeline_rpc import PipelineTraffic
from blocktrain.p2p.pipeline_wire import StageRequest, StageResponse

log = logging.getLogger(__name__)
_COMPUTED: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("bt_pipeline_computed", default=None)
STAGE_MARGIN_S = 0.5      # a stage keeps this much of its caller's deadline for its own backward and answer
MAX_DEFERRED = 2          # window changes in a row a stage may skip its step at (graphs still open) before it steps
CONVICTED_BAN_S = 60.0    # a holder whose gradient failed a check (verify.py): banned this long, doubling when caught again


class _Expired(Exception):
    """A stage's forward was still queued when its caller's deadline passed: not run."""


class _Outlier(Exception):
    """The loss screen refused a micro-batch sent to this stage (screen.py): no backward ran."""


@dataclass
class _Work:
    """One micro-batch at this stage between its forward and its backward."""
    out: torch.Tensor | None              # h_b to send on (CPU, detached); None at the last block
    samples: int
    loss: float | None = None             # the loss computed here (last block, or streamed)
    grad_in: torch.Tensor | None = None   # dL/dh_{b-1} once known (CPU)
    x: torch.Tensor | None = None         # backprop, kept graph: the input leaf (None at block 0)
    h: torch.Tensor | None = None         #   and the output with its graph
    context: torch.Tensor | None = None   #   block 0's bytes, for a recompute
    version: int = -1                     #   the weights the graph was built with
    weights: "_Weights | None" = None     #   and a copy of them (weight stashing)
    window: tuple[str, int] | None = None  # (origin, window) of a flushed micro-batch
    open: bool = False                    # its graph is kept and its backward has not run (counted in _open)
    rng: dict | None = None               # recompute: the random state the forward started from (dropout)


class _Weights:
    """A copy of the block's state at one ``weights_version``, shared by the micro-batches whose forward
    ran on it; freed when the last of them is done (weak references count the live copies)."""
    __slots__ = ("version", "state", "nbytes", "__weakref__")

    def __init__(self, version: int, module: torch.nn.Module):
        self.version = version
        self.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.nbytes = sum(v.numel() * v.element_size() for v in self.state.values())


class PipelineEngine:
    def __init__(self, trainer: BlockTrainer, *, n_blocks: int, loop: LoopThread, next_stage: NextStage | None,
                 settings: PipelineSettings, self_peer: str = "", on_step: Callable[[], None] | None = None,
                 idle: Callable[[], bool] | None = None, traffic: PipelineTraffic | None = None,
                 duty: DutyCycle | None = None, stats: PipelineStats | None = None,
                 check: GradientCheck | None = None):
        self.trainer, self.objective = trainer, trainer.objective
        self.b, self.n_blocks, self.last = trainer.block_index, n_blocks, trainer.block_index == n_blocks - 1
        self.mode = self.objective.chain_training
        if self.mode not in ("backprop", "streamed"):
            raise ValueError(f"objective {self.objective.name!r} is block-local: it has no pipeline to run")
        if next_stage is None and not self.last:
            raise ValueError("a stage before the last needs a route to the next block")
        self.loop, self.next, self.settings, self.self_peer = loop, next_stage, settings, self_peer
        self.on_step, self.idle = on_step or (lambda: None), idle or (lambda: False)
        self.stats = stats or PipelineStats()   # a move's new engine carries on the node's totals
        self.duty = duty or DutyCycle()   # block 0 paces its micro-batches to the node's --train-duty
        self._owed = 0.0                  # idle seconds the duty cycle asks for before the next micro-batch
        self._owed_lock = threading.Lock()
        self.traffic = traffic or PipelineTraffic()   # bytes: counted by the wire (client and server side)
        self.accepting = False          # set by the node once it is online (after a late join)
        self.retired = threading.Event()   # the node moved to another block: ``run`` returns
        self.refusal = "this holder is not training yet (still joining)"   # why, while not accepting
        self._held = 0                  # micro-batches this stage holds (loop thread only)
        self._starved = False           # block 0 found no holder of block 1: the driver waits a while
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bt-pipe-compute")
        self._latest: _Weights | None = None            # the copy of the current version (weight stashing)
        self._copies: weakref.WeakSet = weakref.WeakSet()   # every copy a held micro-batch still refers to
        self._shadow: torch.nn.Module | None = None      # a module to run a stashed version on (compute thread)
        self._open = 0                  # kept graphs awaiting their backward (any thread, under _open_lock)
        self._open_lock = threading.Lock()
        self._window_key: tuple[str, int] | None = None   # the (origin, window) this stage's gradients are of
        self._deferred = 0              # window changes in a row at which a step waited for open graphs
        self._unwindowed = 0            # micro-batches without a window since the last step (the count rule)
        self._window_seq = 0            # block 0 with flush: the id of its next window
        self.budget = MicrobatchBudget(settings.timeout_s, settings.timeout_max_s)   # block 0's, per micro-batch
        self.screen = LossScreen(settings.loss_screen)   # losses computed here on what others sent (screen.py)
        self.check = check if check is not None and check.on and self.mode == "backprop" else None   # verify.py
        self._convicted: dict[str, int] = {}   # holders of the next block whose gradient failed a check: times caught
        self._screen_writes = trainer.outside_writes     # the trainer's outside writes the screen has followed

    # -- compute (one thread, under the trainer's lock) ---------------------------------------------
    async def _in_compute(self, fn, *args, expires: float | None = None):
        """Run ``fn(*args)`` on the compute thread. ``expires`` (monotonic): if the call is still queued
        then, it is not run (:class:`_Expired`): its caller has given up on it. The seconds it ran are added
        to the calling task's :data:`_COMPUTED` tally, if it keeps one (block 0's micro-batches, for the duty cycle)."""
        spent = [0.0]
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, self._timed, fn, args,
                                                                    time.monotonic(), expires, spent)
        finally:
            tally = _COMPUTED.get()
            if tally is not None:
                tally[0] += spent[0]

    def _timed(self, fn, args, queued: float, expires: float | None = None, spent: list[float] | None = None):
        t0 = time.monotonic()
        self.stats.timed("compute_queue", t0 - queued)
        if expires is not None and t0 >= expires:
            raise _Expired(f"its deadline passed {t0 - expires:.1f}s before the compute thread was free "
                           f"(queued {t0 - queued:.1f}s)")
        self.stats.activity.change(computing=1)
        try:
            return fn(*args)
        finally:
            self.stats.activity.change(computing=-1)
            kind = "forward" if fn in (self._forward, self._forward_again) else "backward"
            took = time.monotonic() - t0
            self.stats.timed(kind, took)
            if spent is not None:
                spent[0] = took

    def _forward(self, h_in: torch.Tensor | None, context: torch.Tensor | None, targets: torch.Tensor,
                 window: tuple[str, int] | None = None) -> _Work:
        """Run block b on one micro-batch. At the last block, and in streamed mode at every block, the
        loss and its backward too (the micro-batch is then done here); else keep the graph."""
        t, obj, dev = self.trainer, self.objective, self.trainer.device
        n = int(targets.shape[0])
        with t.lock, layer_checkpointing(self.settings.layer_checkpoint):
            if window is not None and self.b != 0:
                self._enter_window(window)
            t.module.train()
            x = None if h_in is None else h_in.to(dev)
            ctx = None if context is None else context.to(dev)
            keep = self.mode == "backprop" and not self.last
            recompute = keep and self.settings.recompute   # no graph kept: the input and the random state only
            rng = rng_state(dev) if recompute else None
            if x is not None and self.mode == "backprop" and not recompute:
                x.requires_grad_(True)
            with torch.no_grad() if recompute else contextlib.nullcontext():
                h = obj.stage_forward(t.module, self.b, x, ctx)
            if keep:
                with self._open_lock:
                    self._open += 1
                return _Work(h.detach().cpu(), n, x=x, h=None if recompute else h, context=ctx,
                             version=t.weights_version,
                             weights=self._stash_current() if self.settings.weight_stash else None,
                             window=window, open=True, rng=rng)
            loss, _ = obj.stage_loss(t.module, self.b, h, targets.to(dev))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at block {self.b}")
            sent = x is not None and self.screen.on   # another holder's activations and targets: screened
            if sent:          # (block 0's own data is not)
                self._follow_outside_writes()
                why = self.screen.refuses(float(loss.detach()))
                if why is not None:
                    raise _Outlier(why)
            loss.backward()
            grad_in = x.grad.detach().cpu() if x is not None and x.grad is not None else None
            work = _Work(None if self.last else h.detach().cpu(), n, float(loss.detach()), grad_in, window=window)
            if sent:
                self.screen.trained(work.loss, h_in.detach(), targets)
            self._accumulated(work.samples, work.loss, windowed=window is not None)
        return work

    def _follow_outside_writes(self) -> None:
        """After weights written from outside training (an averaging round, a loaded state), move the loss
        screen's window by what the write did to the loss of the last micro-batch trained on (screen.py).
        Compute thread, under the trainer's lock."""
        t = self.trainer
        if t.outside_writes == self._screen_writes:
            return
        self._screen_writes = t.outside_writes
        ref = self.screen.reference
        if ref is None:
            return
        inputs, targets, _ = ref
        with torch.no_grad():
            h = self.objective.stage_forward(t.module, self.b, inputs.to(t.device), None)
            loss, _ = self.objective.stage_loss(t.module, self.b, h, targets.to(t.device))
        if torch.isfinite(loss):
            shift = self.screen.rebase(float(loss))
            log.info("loss screen of block %d moved by %+.3f nats/byte after an outside write of the weights",
                     self.b, shift)

    def _release(self, work: _Work | None) -> None:
        """The micro-batch's kept graph will not be backpropagated (done, or dropped): no longer open, and
        its graph, input and weight copy are let go now, even if something (an exception's traceback, a
        task nobody awaited) still refers to the ``_Work`` itself."""
        if work is None:
            return
        with self._open_lock:
            if work.open:
                work.open = False
                self._open -= 1
        work.x = work.h = work.context = work.weights = work.rng = None

    def _enter_window(self, key: tuple[str, int]) -> None:
        """A flushed micro-batch is about to run its forward here (under the trainer's lock): at the first
        one of another window, step on the gradients of the windows before, unless a kept graph still
        awaits its backward (a step would make it stale: wait for the next window change)."""
        if key == self._window_key:
            return
        self._window_key = key
        if not self.trainer.pending_microbatches:
            self._deferred = 0
            return
        with self._open_lock:
            held = self._open
        if held and self._deferred < MAX_DEFERRED:
            self._deferred += 1
            self.stats.add("window_steps_deferred")
            return
        if held:
            self.stats.add("window_steps_forced")
        self._step()

    def _stash_current(self) -> "_Weights":
        """The copy of the current weights (made once per version, under the trainer's lock)."""
        t = self.trainer
        if self._latest is None or self._latest.version != t.weights_version:
            self._latest = _Weights(t.weights_version, t.module)
            self._copies.add(self._latest)
            self.stats.stashed(self.stash_bytes())
        return self._latest

    def stash_bytes(self) -> int:
        """Bytes of weight copies alive now (the current version's and those held micro-batches need)."""
        return sum(w.nbytes for w in list(self._copies))

    def _backward(self, work: _Work, grad_out: torch.Tensor, loss: float | None) -> torch.Tensor | None:
        """Backprop mode: dL/dh_b -> the block's gradients (accumulated) and dL/dh_{b-1}."""
        t = self.trainer
        with t.lock, layer_checkpointing(self.settings.layer_checkpoint):
            if not work.open:   # released already (its caller was cancelled): nothing left to backpropagate
                return None
            # read once: a cancelled caller may release the work (and let go of its tensors) meanwhile
            x, h, ctx, weights, rng = work.x, work.h, work.context, work.weights, work.rng
            stale = work.version != t.weights_version   # the weights moved since the forward
            if stale:
                self.stats.add("recomputed")
            if stale or h is None:                    # run the forward again (h is None: --pipeline-recompute)
                x = None if x is None else x.detach().requires_grad_(True)
                with rng_restored(rng, t.device):
                    if stale and weights is not None:   # with the weights that forward used (PipeDream)
                        self.stats.add("recomputed_stashed")
                        shadow = self._shadow_with(weights)
                        h = self.objective.stage_forward(shadow, self.b, x, ctx)
                        stage_backward(h, grad_out.to(h.device, h.dtype))
                        live = dict(t.module.named_parameters())
                        for name, p in shadow.named_parameters():
                            if p.grad is not None:
                                q = live[name]
                                q.grad = p.grad.clone() if q.grad is None else q.grad.add_(p.grad)
                                p.grad = None
                        h = None
                    else:
                        t.module.train()
                        h = self.objective.stage_forward(t.module, self.b, x, ctx)
            if h is not None:
                stage_backward(h, grad_out.to(h.device, h.dtype))
            self._release(work)
            self._accumulated(work.samples, loss, windowed=work.window is not None)
            return None if x is None else x.grad.detach().cpu()

    def _shadow_with(self, weights: "_Weights") -> torch.nn.Module:
        """A second module of the block's kind holding ``weights`` (built once; compute thread, under the lock)."""
        if self._shadow is None:
            self._shadow = copy.deepcopy(self.trainer.module)
            for p in self._shadow.parameters():
                p.grad = None
        self._shadow.load_state_dict(weights.state)
        self._shadow.train()
        return self._shadow

    def _accumulated(self, samples: int, loss: float | None, windowed: bool = False) -> None:
        """One more micro-batch in the block's gradients; without a window, every ``accumulate`` of
        those a step (windowed ones step at window changes: :meth:`_enter_window`, :meth:`_window`)."""
        self.stats.add("microbatches_accumulated")
        self.trainer.add_microbatch(samples, loss)
        if not windowed:
            self._unwindowed += 1
            if self._unwindowed >= self.settings.accumulate:
                self._step()

    def _step(self) -> None:
        """One optimizer step on every pending micro-batch (dropped while idle). Under the trainer's lock."""
        self._unwindowed = self._deferred = 0
        if self.trainer.step_accumulated(apply=not self.idle()) is not None:
            self.stats.add("steps")
            self.on_step()

    # -- a stage: serve rpc_train ---------------------------------------------------------------------
    async def handle(self, req: StageRequest) -> StageResponse:
        """The TrainHandler of ``p2p.pipeline_rpc``: raises HopRequestError (busy, downstream, ...)."""
        if not self.accepting:
            self.stats.add("refused_busy")
            raise HopRequestError("busy", self.refusal)
        if self._held >= self.settings.max_stash:
            self.stats.add("refused_busy")
            raise HopRequestError("busy", f"this stage holds {self._held} micro-batches, its limit")
        self._held += 1
        self.stats.held(self._held)
        self.stats.add("received")
        self.stats.activity.change(inflight=1)
        t0 = time.monotonic()
        work = None
        window = None if req.window is None else (req.origin, req.window)
        try:
            work = await self._in_compute(self._forward, req.state, None, req.targets, window,
                                          expires=t0 + req.deadline_s - STAGE_MARGIN_S)
            own = {self.b: work.loss} if work.loss is not None else {}
            if self.last:
                self.stats.add("answered")
                return StageResponse(req.request_id, work.grad_in, work.loss, own, [self.self_peer])
            left = req.deadline_s - (time.monotonic() - t0) - STAGE_MARGIN_S
            resp = await self._send(self._outgoing(work), req.targets, left, req.origin, req.window)
            grad = None
            if self.mode == "backprop":
                await self._checked(work, req.targets, resp)
                grad = await self._in_compute(self._backward, work, resp.grad, resp.loss)
            self.stats.add("answered")
            return StageResponse(req.request_id, grad, resp.loss, {**own, **resp.losses},
                                 [self.self_peer, *resp.route])
        except DownstreamFailed as e:
            self.stats.add("failed_downstream")
            code = e.reason if e.reason in ("timeout", "outlier") else "downstream"   # outlier: nobody retries it
            raise HopRequestError(code, f"block {self.b + 1} and on: {e}") from None
        except _Outlier as e:   # not trained on: the caller gets the typed answer, no gradient
            self.stats.add("refused_outlier")
            raise HopRequestError("outlier", f"block {self.b}: {e}") from None
        except _Expired as e:   # the caller's deadline passed while the forward waited: no compute spent on it
            self.stats.add("expired_in_queue")
            raise HopRequestError("timeout", f"block {self.b}: {e}") from None
        except FloatingPointError as e:
            raise HopRequestError("internal", str(e)) from None
        finally:
            self._release(work)
            self.stats.timed("serve", time.monotonic() - t0)
            self._held -= 1
            self.stats.activity.change(inflight=-1)

    async def _checked(self, work: _Work, targets: torch.Tensor, resp: StageResponse) -> None:
        """Before a backward: the gradient check (verify.py) of this answer, if one is due. A failed check bans the
        holder that answered; a failed or inconclusive one drops the micro-batch (DownstreamFailed)."""
        c = self.check
        if c is None or resp.grad is None or not resp.route or not c.due(resp.route[0], self.trainer.step):
            return
        peer = resp.route[0]
        sent = work.out if work.out is not None else await self._in_compute(self._forward_again, work, False)
        self.stats.add("gradient_checks")
        try:
            why, convicted = await c.check(sent, targets, resp.grad, resp.route)
        except CheckInconclusive as e:   # set aside for the short collateral ban (it may be merely busy), where
            self.stats.add("gradient_checks_inconclusive")   # another holder can take its place
            if any(p != peer for p in await self.next.holders(self.b + 1, False)):
                self.next.bans.strike([peer], f"pipeline block {self.b + 1}: its answer could not be checked: {e}",
                                      attributable=False)
            raise DownstreamFailed("unchecked", f"block {self.b + 1}'s answer could not be checked: {e}") from None
        if why is not None:   # dropped; convicted (failed twice in a row): banned CONVICTED_BAN_S, doubling each time,
            self.stats.add("gradient_checks_failed")   # unless it is the block's only holder (verify.py)
            if convicted and any(p != peer for p in await self.next.holders(self.b + 1, False)):
                n = self._convicted[peer] = self._convicted.get(peer, 0) + 1
                self.next.bans.ban_for(peer, CONVICTED_BAN_S * 2 ** (n - 1), f"pipeline block {self.b + 1}: {why}")
            else:
                log.warning("pipeline block %d: dropped an answer of %s: %s", self.b, peer, why)
            raise DownstreamFailed("bad_gradient", f"block {self.b + 1} holder {peer[-8:]}: {why}")

    def _outgoing(self, work: _Work) -> "torch.Tensor | StateSource":
        """What to send on: the output itself, or, for a recomputing micro-batch (it keeps no graph), a
        source that hands the output over on the first try (the engine keeps no reference: while the
        chain below runs this stage holds only the micro-batch's input) and recomputes it, bit for bit
        (the same random state; the same weights, from a stash if they moved), for a retry."""
        if not (work.open and work.h is None and work.out is not None):
            return work.out
        async def source() -> torch.Tensor:
            if work.out is not None:
                out, work.out = work.out, None
                return out
            return await self._in_compute(self._forward_again, work)
        return source

    def _forward_again(self, work: _Work, resend: bool = True) -> torch.Tensor:
        """A recomputing micro-batch's output once more, for a retry (``resend``: counted as
        ``resent_recomputed``) or for a gradient check of its answer (no graph; compute thread, under the
        lock). The weights it first ran on: the live ones if unchanged, else a stash, else the live ones
        (the retried holder then gets a different h_b: counted as a recompute on new weights)."""
        t = self.trainer
        with t.lock:
            if not work.open:
                raise DownstreamFailed("released", "the micro-batch was let go before its retry")
            x, ctx, weights, rng = work.x, work.context, work.weights, work.rng
            if resend:
                self.stats.add("resent_recomputed")
            stale = work.version != t.weights_version
            module = self._shadow_with(weights) if stale and weights is not None else t.module
            module.train()
            with torch.no_grad(), rng_restored(rng, t.device):
                return self.objective.stage_forward(module, self.b, x, ctx).detach().cpu()

    async def _send(self, out: "torch.Tensor | StateSource", targets: torch.Tensor, deadline_s: float, origin: str,
                    window: int | None = None) -> StageResponse:
        t0 = time.monotonic()
        resp = await self.next.send(self.b + 1, out, targets, deadline_s, origin, window)
        self.stats.timed("call", time.monotonic() - t0)
        self.stats.add("sent")
        return resp

    # -- a block-0 holder: read data, keep micro-batches in flight ------------------------------------
    async def _microbatch(self, windows: torch.Tensor, window: int | None = None) -> float:
        """One micro-batch from block 0, to its end (any outcome, counted). Returns the seconds this node's
        compute thread spent on it (its forward, a retry's recompute, its backward and step): what the duty
        cycle charges, not the time it waited on the chain below."""
        tally = [0.0]
        _COMPUTED.set(tally)     # this task's own context (each micro-batch is a task of its own)
        await self._drive(windows, window)
        return tally[0]

    async def _drive(self, windows: torch.Tensor, window: int | None) -> None:
        if not self.last and not await self.next.any_holder(self.b + 1):
            self._starved = True     # nobody to send to yet: nothing computed, nothing lost
            return
        self.stats.add("started")
        self.stats.activity.change(inflight=1)
        work = None
        key = None if window is None else (self.self_peer, window)
        try:
            ctx, y = windows[:, :-1], windows[:, 1:]
            work = await self._in_compute(self._forward, None, ctx, y, key)
            if not self.last:
                budget = self.budget.current()
                t0 = time.monotonic()
                try:
                    resp = await self._send(self._outgoing(work), y, budget, self.self_peer, window)
                except DownstreamFailed as e:
                    if e.reason == "timeout":
                        self.budget.timed_out(budget)
                    raise
                self.budget.completed(time.monotonic() - t0)
                if self.mode == "backprop":
                    await self._checked(work, y, resp)
                    await self._in_compute(self._backward, work, resp.grad, resp.loss)
            self.stats.add("completed")
        except DownstreamFailed as e:
            self.stats.lose(e.reason)
            drop_tracebacks(e)   # counted: its frames (this micro-batch's tensors) go now, not at a gc pass
        except FloatingPointError as e:
            self.stats.lose("non_finite")
            drop_tracebacks(e)
        except Exception as e:   # a bug must not pass silently, nor stop the driver
            log.exception("pipeline micro-batch failed")
            self.stats.lose("error")
            drop_tracebacks(e)
        finally:
            self._release(work)
            self.stats.activity.change(inflight=-1)

    def run(self, stop: threading.Event) -> None:
        """The node's train loop body: block 0 drives micro-batches; other blocks only serve. Returns
        when ``stop`` is set or the engine is retired (:meth:`retire`: a rebalancing move)."""
        self.accepting = not stop.is_set() and not self.retired.is_set()
        if self.b != 0:
            while not stop.is_set() and not self.retired.wait(0.5):
                pass
            return
        slots = threading.BoundedSemaphore(self.settings.inflight)
        t = self.trainer
        while not stop.is_set() and not self.retired.is_set():
            if self.idle() or self._starved:
                self._starved = False
                stop.wait(0.5 if self.idle() else 1.0)
                continue
            if self.settings.flush:
                self._window(stop)
                continue
            t0 = time.monotonic()
            while not slots.acquire(timeout=0.5):
                if stop.is_set() or self.retired.is_set():
                    return
            self.stats.waited(time.monotonic() - t0)
            with self._owed_lock:
                owed, self._owed = self._owed, 0.0
            if owed and stop.wait(owed):
                slots.release()
                return
            windows = t.sampler.next_batch(t.cfg.batch_size)
            started = time.monotonic()
            try:
                fut = self.loop.submit(self._microbatch(windows))
            except RuntimeError:   # the event loop is gone: the node is stopping
                slots.release()
                return
            fut.add_done_callback(lambda f, started=started: self._done(slots, started, f))

    def _done(self, slots: threading.BoundedSemaphore, started: float, fut: concurrent.futures.Future) -> None:
        """A micro-batch ended (any outcome): owe the duty cycle's pause for the compute it took here (its
        wall time if it did not say), free its slot. The time it waited on the chain below is not charged: a
        chain that is slow, or a holder that stalls until the budget runs out, kept this node idle, not busy
        (charged, a 60-s stall at --train-duty 0.1 idled block 0 for 9 minutes after it)."""
        try:
            busy = fut.result() if not fut.cancelled() else None
        except BaseException:
            busy = None
        pause = self.duty.pause(time.monotonic() - started if busy is None else busy)
        with self._owed_lock:
            self._owed += pause
        slots.release()

    def _window(self, stop: threading.Event) -> None:
        """GPipe-style flush: ``inflight`` micro-batches sent together, marked with this window's id, all
        finished (or lost) before the next window; then block 0 steps, and every other holder steps when
        the next window reaches it (:meth:`_enter_window`), so no backward meets weights newer than its
        forward's, whatever failed. Bounded: each micro-batch is bounded by the budget (at most ``timeout_max_s``)."""
        t, futs = self.trainer, []
        window, self._window_seq = self._window_seq, self._window_seq + 1
        for _ in range(self.settings.inflight):
            try:
                futs.append(self.loop.submit(self._microbatch(t.sampler.next_batch(t.cfg.batch_size), window)))
            except RuntimeError:   # the event loop is gone: the node is stopping
                break
        t0 = time.monotonic()
        pending = set(futs)
        while pending and not stop.is_set() and not self.retired.is_set():
            _, pending = concurrent.futures.wait(pending, timeout=0.5)
        self.stats.waited(time.monotonic() - t0)
        if stop.is_set() or self.retired.is_set():
            return
        t1 = time.monotonic()
        with t.lock:
            self._step()
        busy = time.monotonic() - t1 + sum(f.result() for f in futs if f.done() and not f.cancelled()
                                            and f.exception() is None)
        pause = self.duty.pause(busy)   # this node's compute in the window, as for one micro-batch (_done)
        if pause:
            stop.wait(pause)

    # -- reporting and teardown ----------------------------------------------------------------------
    def status(self) -> dict:
        s = self.settings
        return {"mode": self.mode, "block": self.b, "last": self.last, "held_now": self._held,
                "settings": {"inflight": s.inflight, "accumulate": s.accumulate, "compression": s.codec,
                             "timeout_s": s.timeout_s, "timeout_max_s": s.timeout_max_s, "max_stash": s.max_stash,
                             "retries": s.retries,
                             "weight_stash": s.weight_stash, "flush": s.flush, "recompute": s.recompute,
                             "layer_checkpoint": s.layer_checkpoint},
                **self.stats.snapshot(), "traffic": self.traffic.snapshot(),
                "budget": self.budget.snapshot() if self.b == 0 and not self.last else None}

    def leave(self) -> None:
        """The node is stopping: refuse new micro-batches (``busy``: their senders try another holder)."""
        self.refusal = "this holder is leaving"
        self.accepting = False

    def retire(self) -> None:
        """The node moved to another block: refuse new micro-batches (``busy``) and end :meth:`run`;
        micro-batches already here finish or expire as usual."""
        self.refusal = "this holder moved to another block"
        self.accepting = False
        self.retired.set()

    def close(self) -> None:
        self.leave()
        self._compute.shutdown(wait=False, cancel_futures=True)
