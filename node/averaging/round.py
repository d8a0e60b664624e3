"""Gossip averaging of same-block replicas with hivemind's DecentralizedAverager.

No coordinator: replicas of block b of run R meet under the DHT prefix ``{R}_block{b}`` every
few local steps, all-reduce their parameters weighted by samples since the last round, and each
one accepts the result only after robust checks (``acceptance.py``). Training never waits on a
round: rounds run in their own thread, and the accepted *change* (average - snapshot) is added to
the live weights, so steps taken during the round are kept. The averager also serves the block's
current state to late joiners (``load_state_from_peers``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator  # hivemind reads the rpc_* handlers' type hints

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from blocktrain.node.averaging.acceptance import (AcceptancePolicy, PeerBans, Verdict, check_group, judge, round_completeness,
                         weight_sketch)
from blocktrain.node.trainer import BlockTrainer

log = logging.getLogger(__name__)
# "could not find a group" is the normal outcome of a round with no same-block peer online;
# hivemind logs it as an error with a traceback. Our own stats and log lines report rounds.
logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)

# --averaging-compression: what the all-reduce puts on the wire for each tensor part
COMPRESSIONS = ("fp32", "fp16", "8bit")


def make_compression(name: str):
    """hivemind compression for ``fp32`` (none), ``fp16`` (half floats) or ``8bit`` (uniform 8-bit
    quantization over +-6 sigma of each part, with a 256-entry float32 codebook per part)."""
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization
    table = {"fp32": NoCompression, "fp16": Float16Compression, "8bit": Uniform8BitQuantization}
    if name not in table:
        raise ValueError(f"averaging compression must be one of {', '.join(COMPRESSIONS)}, got {name!r}")
    return table[name]()


# Traffic counters shared with the averager's child process: bytes sent, bytes received,
# messages sent, messages received (serialized protobuf sizes of every libp2p stream message).
_SENT, _RECV, _MSENT, _MRECV = range(4)


def _count_stream_messages(counters) -> None:
    """In the averager's own process: count every protobuf message hivemind writes to or reads from
    a libp2p stream (matchmaking, all-reduce parts, state downloads). All of hivemind's stream I/O
    goes through ``P2P.send_protobuf`` / ``P2P.receive_protobuf``; patching them here touches only
    this child process, whose only p2p traffic is the averager's."""
    from hivemind.p2p import P2P
    send, receive = P2P.send_protobuf, P2P.receive_protobuf

    async def counted_send(protobuf, writer):
        await send(protobuf, writer)
        counters[_SENT] += protobuf.ByteSize()
        counters[_MSENT] += 1

    async def counted_receive(input_protobuf_type, reader):
        msg, err = await receive(input_protobuf_type, reader)
        got = msg if msg is not None else err
        if got is not None:
            counters[_RECV] += got.ByteSize()
            counters[_MRECV] += 1
        return msg, err

    P2P.send_protobuf = staticmethod(counted_send)
    P2P.receive_protobuf = staticmethod(counted_receive)


def patch_8bit_decoder() -> None:
    """hivemind 1.1.12 reads an 8-bit part's codebook size with ``int()`` of a 1-element array, which
    NumPy 2 refuses: every 8-bit part then fails to decode and the round silently averages nothing.
    Same decoding, reading the size as a scalar (in the averager's process only)."""
    import numpy as np
    from hivemind.compression.quantization import Quantization

    def extract(self, serialized_tensor):
        buf = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buf, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buf, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    Quantization.extract = extract


class _BlockStateAverager(DecentralizedAverager):
    """A DecentralizedAverager whose shared state is the trainer's live block (for late joiners)."""

    trainer: BlockTrainer | None = None
    bt_counters = None   # mp.RawArray("q", 4), set before the process starts

    def run(self):   # in the averager's child process
        if self.bt_counters is not None:
            _count_stream_messages(self.bt_counters)
        patch_8bit_decoder()
        super().run()

    def get_current_state(self):
        t = self.trainer
        if t is None:
            return super().get_current_state()
        with t.lock:
            tensors = [p.detach().to("cpu").clone() for p in t.module.parameters()]
            meta = {"step": t.step, "samples_seen": t.samples_seen, "config_hash": t.cfg.config_hash,
                    "block_index": t.block_index}
        return meta, tensors, self.tensor_infos

    # -- private runs and bans: enforced in the averager's own process, before any tensor moves --
    bt_authorize = None              # callable(peer id) -> bool (private runs), set before start
    _bt_refused: frozenset = frozenset()   # peers banned by the node, refreshed before each round

    def bt_set_refused(self, peers) -> None:   # host side: hand the current ban list to the child
        self._outer_pipe.send(("_bt_set_refused", [sorted(str(p) for p in peers)], {}))

    async def _bt_set_refused(self, peers) -> None:
        self._bt_refused = frozenset(peers)

    def _bt_member_ok(self, peer) -> bool:
        p = str(peer)
        return p not in self._bt_refused and (self.bt_authorize is None or bool(self.bt_authorize(p)))

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._bt_member_ok(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self.bt_authorize is not None and not self.bt_authorize(str(_context.remote_id)):
            return   # an empty answer: the caller moves on to the next peer
        async for message in super().rpc_download_state(_request, _context):
            yield message

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        refused = [str(p) for p in group_info.peer_ids if p != self.peer_id and not self._bt_member_ok(p)]
        if refused:   # leave before sending or receiving any tensor part
            raise MatchmakingException(f"{REFUSED_GROUP} {', '.join(refused)}")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)


REFUSED_GROUP = "refused to average with banned or not-allowed peer(s):"


@dataclass
class AveragingStats:
    attempted: int = 0
    succeeded: int = 0
    rejected: int = 0
    failed: int = 0
    partial: int = 0          # accepted rounds whose result moved < 90 % of the way to the group's mean
    last_completeness: float | None = None
    last_round_time: float | None = None
    last_accepted_time: float | None = None
    last_group_size: int = 0
    last_verdict: str = ""
    last_failure: str = ""    # why the last round that formed no usable group failed
    history: list = field(default_factory=list)   # (time, group size, accepted, reason)
    compression: str = "fp32"


class BlockAverager:
    def __init__(self, dht, trainer: BlockTrainer, run_id: str, *, peer_id: str = "",
                 policy: AcceptancePolicy | None = None, target_group_size: int = 4,
                 matchmaking_time: float = 3.0, round_timeout: float = 20.0, allreduce_timeout: float = 30.0,
                 compression=None,
                 banned: "callable | None" = None, authorize: "callable | None" = None,
                 prefix: str | None = None, bans: PeerBans | None = None):
        from hivemind.compression import NoCompression
        self.trainer, self.run_id, self.peer_id = trainer, run_id, peer_id
        self.policy = policy or AcceptancePolicy()
        self.round_timeout = round_timeout          # matchmaking: find a group within this many seconds
        self.allreduce_timeout = allreduce_timeout  # then the all-reduce itself, whatever peers do
        self.stats = AveragingStats()
        self.round_no = 0
        self.banned = banned
        self.prefix = prefix or f"{run_id}_block{trainer.block_index}"
        self.authorize = authorize          # private runs: may this peer average with us?
        self.bans = bans or PeerBans()      # peers blamed for rejected rounds (see acceptance.py)
        if isinstance(compression, str):
            self.stats.compression = compression
            compression = make_compression(compression)
        tensors = [p.detach().to("cpu").clone() for p in trainer.module.parameters()]
        self.averager = _BlockStateAverager(
            averaged_tensors=tensors, dht=dht, start=False, prefix=self.prefix,
            target_group_size=target_group_size, min_group_size=2, min_matchmaking_time=matchmaking_time,
            request_timeout=max(1.0, matchmaking_time / 2), compression=compression or NoCompression(),
            allow_state_sharing=True, next_chunk_timeout=10.0, sender_timeout=5.0, reducer_timeout=10.0,
            allreduce_timeout=allreduce_timeout,   # hivemind's default (None) lets a round with a dead
        )                                          # member hold the averaged tensors' lock for ever
        self.averager.trainer = trainer
        self.averager.bt_authorize = authorize
        self.counters = self.averager.bt_counters = mp.RawArray("q", 4)
        self.averager.run_in_background(await_ready=True, timeout=60)
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()

    def traffic(self) -> dict:
        """What this averager's process put on / took off libp2p streams so far: serialized protobuf
        bytes and messages (matchmaking, all-reduce, state sharing; not DHT records, not libp2p's own
        framing and encryption)."""
        c = self.counters
        return {"bytes_sent": int(c[_SENT]), "bytes_received": int(c[_RECV]),
                "messages_sent": int(c[_MSENT]), "messages_received": int(c[_MRECV])}

    # -- late joiners -----------------------------------------------------------------------------
    def download_state(self, timeout: float = 30.0) -> dict | None:
        """Fetch the block's current state from a live holder; returns its metadata or None."""
        got = self.averager.load_state_from_peers(timeout=timeout)
        if got is None:
            return None
        meta, tensors = got
        params = list(self.trainer.module.parameters())
        if not isinstance(meta, dict) or meta.get("config_hash") != self.trainer.cfg.config_hash:
            raise ValueError("a peer offered state for a different config; refusing it")
        if len(tensors) != len(params) or any(t.shape != p.shape for t, p in zip(tensors, params)):
            raise ValueError("a peer offered block state of the wrong shape; refusing it")
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            raise ValueError("a peer offered non-finite block state; refusing it")
        fresh, offered = self.trainer.check_loss(), self._check_loss(tensors)
        if not offered < fresh + self.policy.max_loss_increase:   # NaN fails too
            raise ValueError(f"a peer offered block state whose held-out check loss ({offered:.3f}) is worse "
                             f"than this block's own ({fresh:.3f}); refusing it")
        with self.trainer.lock:
            for p, t in zip(params, tensors):
                p.data.copy_(t.to(p.device, p.dtype))
            self.trainer.step = int(meta.get("step", 0))
            self.trainer.samples_seen = int(meta.get("samples_seen", 0))
        return meta

    # -- one round --------------------------------------------------------------------------------
    def round(self) -> Verdict | None:
        """Run one averaging round now (blocking this thread). None if no group formed."""
        with self._lock:
            return self._round()

    def _round(self) -> Verdict | None:
        t = self.trainer
        self.round_no += 1
        self.stats.attempted += 1
        if not t.upstream_ready():   # forward-chained: cannot judge a round without blocks < b
            return self._failed("waiting for snapshots of the upstream blocks (forward-chained)")
        with t.lock:
            snapshot = [p.detach().to("cpu").clone() for p in t.module.parameters()]
            weight = float(max(1, t.samples_since_average))
            step = t.step
        try:
            with self._shared_tensors() as shared:
                for s, x in zip(shared, snapshot):
                    s.copy_(x)
        except TimeoutError as e:
            return self._failed(str(e))
        stamp = {"round": self.round_no, "step": step, "peer": self.peer_id,
                 "config_hash": t.cfg.config_hash, "n_tensors": len(snapshot),
                 "weight": weight, "sketch": weight_sketch(snapshot)}
        gathered, error = None, None
        try:
            self.averager.bt_set_refused(self.bans.banned())
            control = self.averager.step(gather=stamp, weight=weight, timeout=self.round_timeout,
                                         allow_retries=False, wait=False)
            deadline = time.monotonic() + self.round_timeout + self.allreduce_timeout + 5
            while not control.done():
                if self.cancel_event.is_set() or time.monotonic() > deadline:
                    control.cancel()
                    break
                time.sleep(0.1)
            if control.done() and not control.cancelled():
                gathered = control.result(timeout=1)
        except Exception as e:  # hivemind raises on broken rounds; training goes on regardless
            log.info("averaging round %d failed: %s", self.round_no, e)
            error = e
        if not gathered:
            if error is not None and REFUSED_GROUP in str(error):   # we left a group holding banned peers
                self.stats.rejected += 1
                verdict = Verdict(False, str(error)[str(error).index(REFUSED_GROUP):])
                self.stats.last_verdict = verdict.reason
                self.stats.history.append((time.time(), 0, False, verdict.reason))
                del self.stats.history[:-100]
                return verdict
            return self._failed(f"{type(error).__name__}: {error}" if error is not None else
                                "no group formed (no same-block peer joined the round)")
        gathered = {str(k): v for k, v in gathered.items()}
        others = [p for p in gathered if p != self.peer_id]
        verdict = check_group(gathered, self_peer=self.peer_id, config_hash=t.cfg.config_hash,
                              n_tensors=len(snapshot), authorize=self.authorize, banned=self._is_banned)
        if verdict is not None:
            self.bans.strike(verdict.offenders, verdict.reason, attributable=True)
        else:
            try:
                with self._shared_tensors() as shared:
                    averaged = [s.detach().clone() for s in shared]
            except TimeoutError as e:
                return self._failed(str(e))
            verdict = judge(snapshot, averaged, self.policy, self._check_loss)
            if verdict.accepted:
                self.bans.forgive(others)
            else:   # the mean cannot be pinned on one member: blame every other member (acceptance.py)
                verdict = dataclasses.replace(verdict, offenders=tuple(sorted(others)))
                self.bans.strike(others, verdict.reason, attributable=len(others) == 1)
        self.stats.last_group_size = len(gathered)
        self.stats.last_round_time = time.time()
        self.stats.last_verdict = verdict.reason
        self.stats.history.append((time.time(), len(gathered), verdict.accepted, verdict.reason))
        del self.stats.history[:-100]
        if not verdict.accepted:
            self.stats.rejected += 1
            log.warning("rejected averaging round %d: %s", self.round_no, verdict.reason)
            return verdict
        with t.lock:
            for p, a, s in zip(t.module.parameters(), averaged, snapshot):
                p.data.add_((a - s).to(p.device, p.dtype))
            t.samples_since_average = 0
        self.stats.succeeded += 1
        self._note_completeness(gathered, stamp, averaged)
        self.stats.last_accepted_time = time.time()
        return verdict

    def _failed(self, why: str) -> None:
        self.stats.failed += 1
        self.stats.last_failure = why[:300]

    @contextlib.contextmanager
    def _shared_tensors(self):
        """The averager's tensors, like hivemind's ``get_tensors()`` but waiting a bounded time for its
        lock (held by the averager process during an all-reduce, itself bounded by allreduce_timeout)."""
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=self.allreduce_timeout + 5):
            raise TimeoutError("the averager is still busy with an earlier all-reduce")
        try:
            yield self.averager._averaged_tensors
        finally:
            lock.release()

    def _note_completeness(self, gathered: dict, stamp: dict, averaged) -> None:
        """Diagnostics only: did the all-reduce average every part? (members' claims are not trusted
        for acceptance; a member that lies here only skews this counter)."""
        try:
            members = [(float(g["weight"]), [float(x) for x in g["sketch"]]) for g in gathered.values()]
            if any(len(s) != len(stamp["sketch"]) or not all(map(math.isfinite, [w, *s])) for w, s in members):
                return   # a member sent no usable sketch (an older node, or garbage)
            c = round_completeness(stamp["sketch"], weight_sketch(averaged), members)
        except (KeyError, TypeError, ValueError):
            return
        if c is not None and not math.isfinite(c):
            return
        self.stats.last_completeness = c
        if c is not None and c < 0.9:
            self.stats.partial += 1
            log.info("averaging round %d was partial: moved %.0f %% of the way to the group's mean",
                     self.round_no, 100 * c)

    def _is_banned(self, peer: str) -> bool:
        return self.bans.is_banned(peer) or (self.banned is not None and bool(self.banned(peer)))

    def _check_loss(self, tensors) -> float:
        t = self.trainer
        probe = t.objective.build_block(t.block_index).to(t.device)
        with torch.no_grad():
            for p, x in zip(probe.parameters(), tensors):
                p.copy_(x.to(p.device, p.dtype))
        return t.check_loss(probe)

    def shutdown(self) -> None:
        self.cancel_event.set()
        try:
            self.averager.shutdown()
        except Exception:  # already gone
            pass
