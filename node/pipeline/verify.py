"""Gradient checks: a stage recomputes sampled answers of the next block's holders before it backpropagates them.

A stage of block b < B-1 backpropagates whatever dL/dh_b the holder of block b+1 answers, and announcing oneself
as that holder is open to anyone. One Sybil announced for block 1 of a 2-block run, answering each micro-batch with
the true gradient negated (the honest norm, the honest loss), was picked for 79-96 % of block 0's micro-batches
(it answers fastest) and took the chain's held-out CE from 2.52 to 17.7 in two minutes
(docs/records/s36/sybil_gradient_probe.py, RELIABILITY.md gap 13). No property of one answer tells a negated
gradient from an honest one; recomputing it does (the idea of BTARD's validators, Gorbunov et al., 2022).

So (opt-in, ``--pipeline-check-rate``: off by default, RELIABILITY.md says why) before it backpropagates an answer,
once its own block has taken ``after_steps`` optimizer steps (before that
honest answers disagree with a recomputation too: from a fresh init every step moves the weights by a large part of
themselves; measured, cosines of -0.05 and -0.12 at step 2 of a 4-block run with 4 micro-batches in flight), the
stage checks the first answer of every holder it has not checked yet, and afterwards a sampled ``rate`` of answers: it downloads the state of every block on the answer's route (blocks
b+1 .. B-1, each from the holder the route names, over the block-state RPC any member may call), runs the
micro-batch it sent through them (evaluation mode) to the loss on its targets, and compares the gradient it gets
with the answer's. A cosine similarity under ``min_cosine`` (0: pointing away from the recomputed gradient) fails
the check: the micro-batch is dropped (its gradient never reaches the block), and the holder's next answer is
checked too; failing twice in a row convicts it, and the engine bans it (node/routing/bans.py), unless it is the
block's only holder (then its failing answers are only dropped: a false conviction would stop the chain). Honest
answers pass although the holders' weights moved between their backward and the download (a few optimizer steps,
replicas averaging): the cosine stays well above 0. A check that cannot finish (a state download refused or timed out, a route of
the wrong length) drops the micro-batch and leaves the holder due for the next check; the engine sets it aside for
the short collateral ban (doubling with each strike) where another holder of the block can take its place: a holder
that never lets itself be checked trains nothing, and is asked less and less.

Limits (RELIABILITY.md "Training traffic"): between checks an answer is trusted, so an attacker that answers
honestly until checked, then lies, gets about 1 / ``rate`` lies through per identity it announces; an attacker
that serves, for its state downloads, weights whose true gradient is the harmful one passes; a check costs the
downloads and one forward and backward of every block below this one.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable

import torch

log = logging.getLogger(__name__)

__all__ = ["GradientCheck", "CheckInconclusive"]

StateFetch = Callable[[str, int], Awaitable[dict[str, torch.Tensor]]]   # (peer, block) -> its named state


class CheckInconclusive(Exception):
    """The check could not be made (a download failed, a malformed route): not the holder's proven fault."""


class GradientCheck:
    def __init__(self, objective, block: int, n_blocks: int, fetch: StateFetch, *, rate: float = 0.05,
                 min_cosine: float = 0.0, after_steps: int = 200, rng: random.Random | None = None):
        self.objective, self.b, self.n_blocks, self.fetch = objective, block, n_blocks, fetch
        self.rate, self.min_cosine, self.after_steps = rate, min_cosine, after_steps
        self.rng = rng or random.Random()
        self._passed: set[str] = set()   # holders whose last checked answer passed
        self._suspect: set[str] = set()  # holders whose last checked answer failed

    @property
    def on(self) -> bool:
        return self.rate > 0 and self.b < self.n_blocks - 1

    def due(self, peer: str, step: int) -> bool:
        """Is the answer of ``peer`` to be checked, this stage's block being at optimizer step ``step``?"""
        return self.on and step >= self.after_steps and (peer not in self._passed or self.rng.random() < self.rate)

    async def check(self, sent: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor,
                    route: list[str]) -> tuple[str | None, bool]:
        """(None, False) if ``grad`` (answered by ``route[0]`` for ``sent``) agrees with the recomputed gradient;
        else (why not, whether that holder is now convicted: its previous checked answer failed too). Raises
        :class:`CheckInconclusive` when it cannot tell."""
        below = list(range(self.b + 1, self.n_blocks))
        if len(route) != len(below) or not route:
            raise CheckInconclusive(f"the answer's route names {len(route)} holders for blocks {below}")
        try:
            states = await asyncio.gather(*(self.fetch(peer, j) for peer, j in zip(route, below)))
        except Exception as e:
            raise CheckInconclusive(f"downloading the route's states: {type(e).__name__}: {e}") from None
        cos = await asyncio.get_running_loop().run_in_executor(None, self._cosine, sent, targets, grad, below, states)
        if cos is None:
            raise CheckInconclusive("the recomputed gradient is not finite or the states do not fit the blocks")
        log.info("gradient check of %s's answer for blocks %d..%d: cosine %.3f", route[0], below[0], below[-1], cos)
        peer = route[0]
        if cos < self.min_cosine:
            convicted = peer in self._suspect
            self._suspect.add(peer)
            self._passed.discard(peer)
            return (f"its gradient disagrees with the one recomputed from the states of blocks {below[0]}..{below[-1]} "
                    f"(cosine {cos:.3f} < {self.min_cosine}){', the second time in a row' if convicted else ''}"), convicted
        self._passed.add(peer)
        self._suspect.discard(peer)
        return None, False

    def _cosine(self, sent, targets, grad, below, states) -> float | None:
        obj = self.objective
        try:
            blocks = []
            for j, state in zip(below, states):
                m = obj.build_block(j)
                m.load_state_dict(state)
                blocks.append(m.eval())
            x = sent.detach().to(torch.float32).clone().requires_grad_(True)
            h = x
            for j, m in zip(below, blocks):
                h = obj.stage_forward(m, j, h, None)
            loss, _ = obj.stage_loss(blocks[-1], below[-1], h, targets)
            loss.backward()
        except (RuntimeError, KeyError, ValueError) as e:   # a state that does not fit the block
            log.info("gradient check: %s", e)
            return None
        if x.grad is None or not bool(torch.isfinite(x.grad).all()):
            return None
        return float(torch.nn.functional.cosine_similarity(x.grad.flatten(), grad.to(torch.float32).flatten(), dim=0))
