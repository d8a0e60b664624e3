"""One way to fetch a block's current state from the network: late join, a move, upstream snapshots, export.

:meth:`StateFetcher.fetch` asks a block's online holders (not those still joining), best first by this node's own
measurements (``routing/ranking.py``; peers never measured in random order: a claim of steps is anyone's to
make, and ordering by it let Sybil holders claiming 10^9 steps be asked before every honest one), downloads
the state over the block RPC (a holder that sends nothing for ``STATE_IDLE_S`` is given up at once), and keeps the first offer that passes
:meth:`build_checked` (every tensor finite, and the state loads strictly into a fresh block: no
missing, extra or misshapen tensor). A holder that fails is recorded as such and the next one is
asked.

:meth:`StateFetcher.fetch_best` is what a node that will *train* the state uses (late join, a move): it
downloads from up to ``sources`` holders (default :data:`STATE_SOURCES`), judges each checked state and keeps
the best. A well-formed state can still be worthless (an untrained or damaged block offered by a Sybil
holder passes every check above), and only a comparison tells it from an honest holder's: a block-local
block by its own held-out check loss (:class:`LossJudge`), a chain-trained one by the chain's held-out CE
with the offered block in place and the other blocks through the network (:class:`ChainJudge`). Both
refuse a state that is worse than this node's own fresh block by more than the averaging margin.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from blocktrain.node.routing.ranking import HolderRanking
from blocktrain.p2p.errors import drop_tracebacks
from blocktrain.p2p.records import BlockAnnouncement

log = logging.getLogger(__name__)
#: the slowest link a block's state download is given time for (1 MB/s = 8 Mbit/s): measured, a 58.7 MB
#: block took 25 s over 20 Mbit/s and a 131 MB one could not arrive within the former fixed 30 s at all
#: (BENCHMARKS.md "Move time for a real block")
MIN_STATE_RATE_MB_S = 1.0
#: how many holders' states a node that trains the state compares (late join, a move); 1 takes the first
#: acceptable one. Each extra source costs one more download of the block.
STATE_SOURCES = 2


def transfer_timeout(n_bytes: int, base_s: float = 30.0) -> float:
    """Seconds to allow one download of ``n_bytes`` of block state: ``base_s`` for small blocks,
    10 s plus the size at :data:`MIN_STATE_RATE_MB_S` for large ones."""
    return max(base_s, 10.0 + n_bytes / 1e6 / MIN_STATE_RATE_MB_S)


def state_bytes(module: torch.nn.Module) -> int:
    """The bytes of a block's state as the block RPC and the averager send it (its parameters)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class Fetched:
    peer: str
    meta: dict
    tensors: dict[str, torch.Tensor]
    score: float | None = None   # what the judge said (lower is better; None: not judged, or could not be)
    compared: list[dict] = field(default_factory=list)   # fetch_best: every offer judged, with its score or refusal

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())


class StateFetcher:
    def __init__(self, client, objective, *, ranking: HolderRanking | None = None, self_peer: str = "",
                 timeout: float = 30.0, config_hash: str | None = None):
        self.client, self.objective = client, objective
        self.ranking = ranking or HolderRanking()
        self.self_peer, self.timeout = self_peer, timeout
        self.config_hash = config_hash   # if set, a state whose metadata names another config is refused

    @staticmethod
    def build_checked(objective, b: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A fresh block b holding ``tensors``; ValueError if any is non-finite or does not fit."""
        if not all(bool(torch.isfinite(v).all()) for v in tensors.values()):
            raise ValueError(f"the offered state of block {b} is not finite")
        m = objective.build_block(b)
        try:
            m.load_state_dict(tensors)   # strict: refuses missing, unexpected or misshapen tensors
        except RuntimeError as e:
            raise ValueError(f"the offered state of block {b} does not fit: {e}") from None
        return m

    def order(self, holders: Sequence[BlockAnnouncement]) -> list[str]:
        # online holders only: a ``joining`` one is still downloading and has nothing to give yet
        return self.ranking.order([a.peer_id for a in holders if a.state == "online" and a.peer_id != self.self_peer])

    def _download(self, peer: str, b: int, timeout: float | None,
                  errors: list[str] | None) -> tuple[Fetched, torch.nn.Module] | None:
        """Block ``b``'s state from ``peer``, checked (finite, fits, this run's config), with the block built
        from it; None (the reason in ``errors``, the failure in the ranking) if it failed."""
        t0 = time.perf_counter()
        try:
            meta, tensors = self.client.get_block_state_sync(peer, b, timeout=timeout or self.timeout)
            if self.config_hash is not None and meta.get("config_hash") != self.config_hash:
                raise ValueError("its config hash differs from the run's")
            module = self.build_checked(self.objective, b, tensors)
            if module is not None:   # keep the block's own tensors (the same storage), not the download's too
                tensors = {k: v.detach() for k, v in module.state_dict().items()}
        except Exception as e:  # a holder that left or sent junk: try the next one
            self.ranking.record_failure(peer, str(e))
            if errors is not None:
                errors.append(f"state of block {b} from {peer}: {type(e).__name__}: {e}")
                del errors[:-50]
            drop_tracebacks(e)   # a cut stream's frames hold what it delivered: up to a block, freed now
            return None
        self.ranking.record_success(peer, time.perf_counter() - t0)
        return Fetched(peer, meta, tensors), module

    def fetch(self, b: int, holders: Sequence[BlockAnnouncement], *, errors: list[str] | None = None,
              timeout: float | None = None) -> Fetched | None:
        """The first checked state of block ``b`` its holders deliver, or None (reasons in ``errors``)."""
        for peer in self.order(holders):
            got = self._download(peer, b, timeout, errors)
            if got is not None:
                return got[0]
        return None

    def fetch_best(self, b: int, holders: Sequence[BlockAnnouncement], judge: "StateJudge", *,
                   sources: int = STATE_SOURCES, errors: list[str] | None = None,
                   timeout: float | None = None) -> Fetched | None:
        """The best of the checked states of block ``b`` that up to ``sources`` holders deliver, by ``judge``
        (lower is better; a judged state beats one that could not be judged; among those the first);
        None if no holder delivered an acceptable one. A state the judge refuses, or a download that fails,
        does not count as a source (the next holder is asked). The states still wanted are downloaded in
        parallel (each holder's uplink is usually what limits a transfer, not the downloader's link), then
        judged one by one; at most ``sources`` states plus the best so far are held at a time."""
        if sources < 1:
            raise ValueError(f"sources must be >= 1, got {sources}")
        best: Fetched | None = None
        compared: list[dict] = []
        order = self.order(holders)
        with ThreadPoolExecutor(max_workers=sources, thread_name_prefix="bt-state") as pool:
            while order and len([c for c in compared if "refused" not in c]) < sources:
                want = sources - len([c for c in compared if "refused" not in c])
                batch, order = order[:want], order[want:]
                downloads = [pool.submit(self._download, peer, b, timeout, errors) for peer in batch]
                for peer, future in zip(batch, downloads):
                    got = future.result()
                    if got is None:
                        continue
                    fetched, module = got
                    try:
                        score = judge(module)
                    except Exception as e:   # refused (ValueError), or the state broke the judge: ranked as a failed holder
                        self.ranking.record_failure(peer, f"offered a refused state: {e}")
                        compared.append({"peer": peer, "refused": str(e)})
                        if errors is not None:
                            errors.append(f"state of block {b} from {peer} refused: {e}")
                            del errors[:-50]
                        continue
                    finally:
                        del module, got
                    fetched.score = score
                    compared.append({"peer": peer, "score": None if score is None else round(score, 4)})
                    if best is None or (score is not None and (best.score is None or score < best.score)):
                        best = fetched
                    del fetched
        if best is not None:
            best.compared = compared
        return best


class StateJudge(Protocol):
    """Judges a checked block state before a node trains it: a score (lower is better), None if it could
    not be judged now, or ValueError if it is refused."""

    fresh: float | None   # the same judge's score of this node's own fresh block (None: not measured)

    def __call__(self, module: torch.nn.Module) -> float | None: ...


class LossJudge:
    """A block-local block (it has a loss alone) by its own held-out check loss on the trainer's fixed
    check windows; refused if worse than the trainer's fresh block by ``max_increase`` or more."""

    def __init__(self, trainer, max_increase: float):
        self.trainer, self.max_increase = trainer, max_increase
        self.fresh = trainer.check_loss()

    def __call__(self, module: torch.nn.Module) -> float:
        offered = self.trainer.check_loss(module)
        if not offered < self.fresh + self.max_increase:   # NaN fails too
            raise ValueError(f"its held-out check loss ({offered:.3f}) is worse than a fresh block's ({self.fresh:.3f})")
        return offered


class ChainJudge:
    """A chain-trained block (no loss alone) by the chain's held-out CE with the offered block in place:
    ``score(hop_of_the_block) -> nats/byte`` runs the other blocks through the network (the node's router)
    on its fixed held-out windows. Refused if the CE is not finite, or worse than with this node's fresh
    block by ``max_increase`` or more; None (not judged) when the chain cannot be run now (a block without
    a reachable holder): the caller then keeps the first acceptable state, as a plain fetch does."""

    def __init__(self, objective, b: int, score: Callable[[object], float], fresh_module: torch.nn.Module,
                 max_increase: float):
        self.objective, self.b, self._score, self.max_increase = objective, b, score, max_increase
        self.fresh = self._try(fresh_module)

    def _try(self, module: torch.nn.Module) -> float | None:
        was = module.training
        module.eval()
        try:
            return float(self._score(self.objective.make_hop(module, self.b)))
        except Exception as e:   # the network, not the offer: nothing to judge by
            log.info("could not run the chain to judge a state of block %d: %s: %s", self.b, type(e).__name__, e)
            drop_tracebacks(e)
            return None
        finally:
            module.train(was)

    def __call__(self, module: torch.nn.Module) -> float | None:
        ce = self._try(module)
        if ce is None:
            return None
        if not math.isfinite(ce):
            raise ValueError(f"the chain's held-out CE with it in place is {ce}")
        if self.fresh is not None and not ce < self.fresh + self.max_increase:
            raise ValueError(f"the chain's held-out CE with it in place ({ce:.3f}) is worse than with a fresh "
                             f"block ({self.fresh:.3f})")
        return ce
