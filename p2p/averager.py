"""The hivemind seam for gossip averaging: one block's tensors behind a small handle.

:class:`BlockAveragerHandle` owns a ``DecentralizedAverager`` (a child process of hivemind's) for
one block's parameters: matchmaking under a DHT prefix, all-reduce with compression, state
sharing for late joiners. Everything hivemind-specific lives here: the subclass and its patches
(traffic counters, the NumPy-2 fix of the 8-bit decoder, a paced matchmaking search, refusal of banned or not-allowed peers
before any tensor moves) and the bounded waits. Callers (the node's round policy) see plain
tensors in and out: :meth:`round` returns what the group gathered and the averaged tensors, or
raises :class:`RoundFailed` saying why; nothing here decides whether a result is accepted.

hivemind averages its own shared-memory buffers, a second copy of the block. Between rounds nobody
reads them (a round writes them first; downloaders get the trainer's weights through ``state``), so
their pages are given back to the system (:func:`free_shared_pages`) once a round is over: a node
holds its block once except while it averages (a block's only holder, which tries no round, never).

A round leaves in those buffers the *change* it makes (the group's mean minus what we sent: what
hivemind's all-reduce computes anyway, part by part) rather than the mean, and the caller reads
them in place (:meth:`BlockAveragerHandle.round` is a context manager): the node applies the change
to its live weights while training goes on, so it needs no snapshot of its weights and no copy of
the result. Measured (``docs/records/s22/roundpeak.py``): a round's peak above the node fell from
5-6x the block's weights per replica to the all-reduce's own buffers.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import multiprocessing as mp
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator  # hivemind reads the rpc_* handlers' type hints

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

from blocktrain.p2p.inprocess import RunsInThread
from blocktrain.p2p.process import StopsWithParent, stop_process

__all__ = ["BlockAveragerHandle", "RoundFailed", "RoundResult", "COMPRESSIONS", "make_compression",
           "patch_8bit_decoder", "pace_matchmaking", "MATCHMAKING_FETCH_INTERVAL_S", "free_shared_pages"]

log = logging.getLogger(__name__)
# "could not find a group" is the normal outcome of a round with no same-block peer online;
# hivemind logs it as an error with a traceback. The node's own stats and log lines report rounds.
logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)

# what the all-reduce puts on the wire for each tensor part
COMPRESSIONS = ("fp32", "fp16", "8bit")
REFUSED_GROUP = "refused to average with banned or not-allowed peer(s):"

StateProvider = Callable[[], tuple[dict, list[torch.Tensor]]]


def make_compression(name: str):
    """hivemind compression for ``fp32`` (none), ``fp16`` (half floats) or ``8bit`` (uniform 8-bit
    quantization over +-6 sigma of each part, with a 256-entry float32 codebook per part)."""
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization
    table = {"fp32": NoCompression, "fp16": Float16Compression, "8bit": Uniform8BitQuantization}
    if name not in table:
        raise ValueError(f"averaging compression must be one of {', '.join(COMPRESSIONS)}, got {name!r}")
    return table[name]()


_MADV_REMOVE = 9   # Linux: free a shared mapping's pages (and their backing store); they read zeros after


def free_shared_pages(t: torch.Tensor) -> int:
    """Give the pages of a shared-memory tensor (``share_memory_()``) back to the system; it reads
    zeros until written again. Returns the bytes freed: 0 where that is not possible (not Linux,
    not page-aligned, not shared memory), so callers lose nothing but the saving."""
    st = t.untyped_storage()
    n = (st.nbytes() // mmap.PAGESIZE) * mmap.PAGESIZE
    if not sys.platform.startswith("linux") or not st.is_shared() or n == 0 or st.data_ptr() % mmap.PAGESIZE:
        return 0
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return n if _libc.madvise(st.data_ptr(), n, _MADV_REMOVE) == 0 else 0


_libc = None

# Traffic counters shared with the averager's child process: bytes sent, bytes received,
# messages sent, messages received (serialized protobuf sizes of every libp2p stream message).
_SENT, _RECV, _MSENT, _MRECV = range(4)


_COUNTERS: dict[int, Any] = {}   # averager loop thread ident -> its traffic counters
_counting_installed = False


def _count_stream_messages(counters) -> None:
    """In the averager's loop thread (its own process, or a thread of the node's): count every
    protobuf message hivemind writes to or reads from a libp2p stream (matchmaking, all-reduce parts,
    state downloads) from this thread. All of hivemind's stream I/O goes through
    ``P2P.send_protobuf`` / ``P2P.receive_protobuf``; the averager's replica of the P2P client runs
    its streams on the averager's event loop, which is this thread, so other loops of the same
    process (the DHT's, the node's RPC) are not counted."""
    global _counting_installed
    _COUNTERS[threading.get_ident()] = counters
    if _counting_installed:
        return
    _counting_installed = True
    from hivemind.p2p import P2P
    send, receive = P2P.send_protobuf, P2P.receive_protobuf

    async def counted_send(protobuf, writer):
        await send(protobuf, writer)
        c = _COUNTERS.get(threading.get_ident())
        if c is not None:
            c[_SENT] += protobuf.ByteSize()
            c[_MSENT] += 1

    async def counted_receive(input_protobuf_type, reader):
        msg, err = await receive(input_protobuf_type, reader)
        got = msg if msg is not None else err
        c = _COUNTERS.get(threading.get_ident())
        if got is not None and c is not None:
            c[_RECV] += got.ByteSize()
            c[_MRECV] += 1
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


#: the shortest time between two reads of the group key's averagers while matchmaking (see pace_matchmaking)
MATCHMAKING_FETCH_INTERVAL_S = 0.25


def pace_matchmaking(interval: float = MATCHMAKING_FETCH_INTERVAL_S) -> None:
    """hivemind 1.1.12's search for a group re-reads the group key's averagers from the DHT whenever
    ``pop_next_leader`` finds no leader to ask, and it finds none for most of a window (the peer that
    will lead waits for followers; a lone replica waits for no one): the read is repeated as fast as
    the DHT answers, each a DHT ``get`` of several ``rpc_find`` calls through p2pd. Six tiny nodes
    averaging at the node's defaults made ~17 such reads a second each; pacing them took the six
    nodes' CPU, p2pd's included, from 1.9 to 0.9 CPU-seconds per second (BENCHMARKS.md "Matchmaking's DHT reads"). The same loop, at most one read per ``interval``
    seconds: a follower sees a new leader at most that much later, inside a 3 s window. Also, a peer the
    averager refuses (banned, or not allowed in a private run) is never queued as a leader: asked, it
    would assemble a group we then leave before any tensor moves, and a banned peer that kept declaring
    itself first would cost every honest replica that banned it each round while the ban lasts."""
    import asyncio
    from math import isfinite

    from hivemind.averaging import matchmaking

    async def _update_queue_periodically(self, key_manager) -> None:
        discrepancy = matchmaking.MAX_DHT_TIME_DISCREPANCY_SECONDS
        loop = asyncio.get_running_loop()
        while get_dht_time() < self.search_end_time:
            started = loop.time()
            new_peers = await key_manager.get_averagers(key_manager.current_key, only_active=True)
            self.max_assured_time = max(self.max_assured_time, get_dht_time() + self.min_matchmaking_time - discrepancy)
            self.leader_queue.clear()
            refuses = getattr(self, "bt_refuses", None)   # set by BlockStateAverager._step
            for peer, peer_expiration_time in new_peers:
                if peer == self.peer_id or (peer, peer_expiration_time) in self.past_attempts:
                    continue
                if refuses is not None and refuses(peer):   # never ask a refused peer to lead us
                    continue
                self.leader_queue.store(peer, peer_expiration_time, peer_expiration_time)
                self.max_assured_time = max(self.max_assured_time, peer_expiration_time - discrepancy)
            self.update_finished.set()
            await asyncio.wait(
                {asyncio.create_task(self.running.wait()), asyncio.create_task(self.update_triggered.wait())},
                return_when=asyncio.ALL_COMPLETED,
                timeout=self.search_end_time - get_dht_time() if isfinite(self.search_end_time) else None)
            self.update_triggered.clear()
            rest = started + interval - loop.time()   # no second read within `interval`
            if rest > 0:
                await asyncio.sleep(rest)

    _update_queue_periodically.bt_paced = interval
    matchmaking.PotentialLeaders._update_queue_periodically = _update_queue_periodically


class BlockStateAverager(RunsInThread, StopsWithParent, DecentralizedAverager):
    """hivemind's averager with BlockTrain's additions. Set the ``bt_*`` attributes before starting it.

    It runs where its DHT's loop runs: in a thread of the node's process (p2p/inprocess.py), or as
    a node's child process like the DHT's (p2p/process.py: it ignores SIGINT/SIGTERM, the host stops
    it (:meth:`BlockAveragerHandle.shutdown`), and it exits on its own if the host dies).

    * ``bt_state``: callable returning ``(metadata, tensors)`` of the live block: what hivemind's
      state download would serve (it runs in the host process). Sharing is off (``allow_state_sharing``
      False: the download answers nothing); this is the guard that hivemind never serves the averaged
      buffers, which hold a round's change, if it were turned on.
    * ``bt_authorize``: callable(peer id) -> bool for private runs.
    * ``bt_counters``: shared traffic counters (``mp.RawArray("q", 4)``).
    Peers refused by the host (``set_refused``) or not authorized cannot join our group or stay in a
    group we are in: we leave before any tensor part moves.
    """

    bt_state: StateProvider | None = None
    bt_authorize: Callable[[str], bool] | None = None
    bt_counters = None
    _bt_refused: frozenset = frozenset()

    def run(self):   # in the averager's child process, or its thread of the node's
        self._bt_stalls: dict[bytes, tuple[list[str], float]] = {}   # group id -> who stalled it, share not averaged
        patch_8bit_decoder()
        pace_matchmaking()
        super().run()

    def _run_internal(self):   # hivemind's loop, in a thread of its own
        if self.bt_counters is not None:
            _count_stream_messages(self.bt_counters)
        try:
            super()._run_internal()
        finally:
            _COUNTERS.pop(threading.get_ident(), None)

    def _bt_swap_pipes(self) -> None:
        """hivemind's constructor already started the host-side thread that serves our state to
        the loop, reading the old pipe: stop it with hivemind's own ``_SHUTDOWN``, move what was
        already sent, and serve the new pipe with hivemind's same function."""
        from hivemind.averaging.averager import _background_thread_fetch_current_state
        old_inner, old_outer = self._inner_pipe, self._outer_pipe
        pending = []
        while old_inner.poll():
            pending.append(old_inner.recv())
        super()._bt_swap_pipes()
        for message in pending:
            self._outer_pipe.send(message)
        old_inner.send(("_SHUTDOWN", None))
        threading.Thread(target=_background_thread_fetch_current_state, daemon=True,
                         args=[self.serializer, self._outer_pipe, weakref.WeakMethod(self.get_current_state)]
                         ).start()
        self._bt_old_pipes = (old_inner, old_outer)   # closed when this averager is collected

    async def _shutdown(self, timeout) -> None:
        try:
            await super()._shutdown(timeout)
        finally:
            if self.bt_in_thread:   # a process's exit would close its P2P client; a thread must
                try:
                    await self._p2p.shutdown()
                except Exception as e:
                    log.debug("closing the averager's P2P client: %s", e)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind's, without setting the *host's* SIGINT to SIG_IGN (which made a node deaf to
        Ctrl-C): the child ignores SIGINT itself (StopsWithParent)."""
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def get_current_state(self):   # never hivemind's own: the buffers hold a round's change, not the block
        meta, tensors = self.bt_state()
        return meta, tensors, self.tensor_infos

    def set_refused(self, peers) -> None:   # host side: hand the current ban list to the child
        self._outer_pipe.send(("_bt_set_refused", [sorted(str(p) for p in peers)], {}))

    async def _bt_set_refused(self, peers) -> None:
        self._bt_refused = frozenset(peers)

    def _bt_member_ok(self, peer) -> bool:
        p = str(peer)
        return p not in self._bt_refused and (self.bt_authorize is None or bool(self.bt_authorize(p)))

    async def _step(self, *, step, future_for_init):
        # the leaders' queue of this search skips the peers we refuse (pace_matchmaking)
        self._matchmaking.potential_leaders.bt_refuses = lambda peer: not self._bt_member_ok(peer)
        return await super()._step(step=step, future_for_init=future_for_init)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._bt_member_ok(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        refused = [str(p) for p in group_info.peer_ids if p != self.peer_id and not self._bt_member_ok(p)]
        if refused:   # leave before sending or receiving any tensor part
            raise MatchmakingException(f"{REFUSED_GROUP} {', '.join(refused)}")
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            stalled = self._bt_stalls.pop(group_info.group_id, None)
        if isinstance(gathered, dict) and stalled is not None:   # travels with the result (a thread or a process)
            gathered[STALLED_KEY] = stalled
        return gathered

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind 1.1.12's, except that each buffer ends holding the round's change (the delta the
        all-reduce yields: group mean - what we sent) instead of having it added. A tensor's delta
        comes only once every part of it was reduced, so our parts of it were already sent. A
        buffer the all-reduce ended before reaching gets zeros (no change), so a round cut short
        never leaves our own weights posing as a change; the caller sees the round fail anyway."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = AllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                 group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        # members that stalled this all-reduce: reducers that never returned our part (hivemind then keeps
        # our own values for it) and senders that never sent theirs (hivemind leaves them out of the mean)
        container, failed = runner.tensor_part_container, set()
        keep_local = container.register_failed_reducer

        def failed_reducer(peer_index: int):
            failed.add(peer_index)
            return keep_local(peer_index)

        container.register_failed_reducer = failed_reducer
        done = 0
        try:
            async for tensor, delta in azip(as_aiter(*tensors), runner):
                tensor.copy_(delta.mul_(self._averaging_alpha) if self._averaging_alpha != 1 else delta)
                done += 1
                self.last_updated = get_dht_time()
                # hivemind sets ``_state_updated`` here, once per tensor: each wakes the loop that declares
                # our state for download and re-stored it in the DHT (a block's dozen tensors, a dozen
                # DHT stores a round, while sharing was on). Sharing is off now; the loop stays asleep.
        finally:
            for tensor in tensors[done:]:
                tensor.zero_()
            peers = {str(group_info.peer_ids[i]) for i in failed} | {str(p) for p in runner.banned_senders}
            peers.discard(str(self.peer_id))
            if peers:
                self._bt_stalls[group_id] = (sorted(peers), container.failed_size / max(1, container.total_size))


STALLED_KEY = "bt:stalled"   # in a round's gathered metadata: (peer ids that stalled it, share of ours not averaged)


class RoundFailed(Exception):
    """No usable all-reduce: ``refused`` is True when we left a group holding refused peers."""

    def __init__(self, reason: str, *, refused: bool = False):
        super().__init__(reason)
        self.reason, self.refused = reason, refused


@dataclass
class RoundResult:
    gathered: dict[str, Any]          # peer id -> the metadata that member gathered (ours included)
    change: list[torch.Tensor]        # group mean - what we sent: the averager's own buffers, read in place
    stalled: tuple[str, ...] = ()     # members that sent us nothing or never returned the part they reduced
    unaveraged: float = 0.0           # the share of our tensors left as they were because of them


class BlockAveragerHandle:
    """One block's averager process, driven from the host with bounded waits.

    ``matchmaking_time``: the window in which a group forms; ``round_timeout``: matchmaking gives
    up after it; ``allreduce_timeout``: the all-reduce itself, whatever members do (hivemind's
    default, None, lets a round with a dead member hold the averaged tensors' lock for ever).
    """

    def __init__(self, dht, tensors: list[torch.Tensor], *, prefix: str, state: StateProvider,
                 compression: str = "fp32", authorize: Callable[[str], bool] | None = None,
                 target_group_size: int = 4, matchmaking_time: float = 3.0, round_timeout: float = 20.0,
                 allreduce_timeout: float = 30.0, start_timeout: float = 60.0, shutdown_timeout: float = 2.0):
        self.prefix, self.compression = prefix, compression
        self.round_timeout, self.allreduce_timeout = round_timeout, allreduce_timeout
        self.averager = BlockStateAverager(
            averaged_tensors=[t.detach().to("cpu").clone() for t in tensors], dht=dht, start=False,
            prefix=prefix, target_group_size=target_group_size, min_group_size=2,
            min_matchmaking_time=matchmaking_time, request_timeout=max(1.0, matchmaking_time / 2),
            # a DHT in client mode (a member nobody can dial) makes hivemind's averager a client too:
            # it joins groups others lead. hivemind's state sharing stays off: its downloaders ask the
            # peers declared under the prefix in the order of the priority each claims, so a Sybil
            # claiming the most steps was asked first and its untrained state adopted; a block's state
            # travels over the block RPC from announced holders instead, judged (node/state_fetch.py)
            compression=make_compression(compression), allow_state_sharing=False, next_chunk_timeout=10.0,
            sender_timeout=5.0, reducer_timeout=10.0, allreduce_timeout=allreduce_timeout,
            shutdown_timeout=shutdown_timeout)
        self.averager.bt_state = state
        self.averager.bt_authorize = authorize
        self.counters = self.averager.bt_counters = mp.RawArray("q", 4)
        if getattr(dht, "bt_in_thread", False):   # its loop runs where its DHT's does
            self.averager.bt_use_thread()
        self._control = None          # our last step: while it may still run, its buffers are kept
        self.released_bytes = 0       # the averager's buffer pages freed by the last release
        self.averager.run_in_background(await_ready=True, timeout=start_timeout)
        self._release()

    @property
    def peer_id(self) -> str:
        return str(self.averager.peer_id)

    def traffic(self) -> dict[str, int]:
        """What the averager's process put on / took off libp2p streams so far: serialized protobuf
        bytes and messages (matchmaking, all-reduce, state sharing; not DHT records, not libp2p's own
        framing and encryption)."""
        c = self.counters
        return {"bytes_sent": int(c[_SENT]), "bytes_received": int(c[_RECV]),
                "messages_sent": int(c[_MSENT]), "messages_received": int(c[_MRECV])}

    @contextlib.contextmanager
    def staging(self) -> Iterator[list[torch.Tensor]]:
        """The averager's buffers, to fill with the weights of the next :meth:`round` (the caller
        copies its live weights in under its own lock; a bounded wait here first, never under the
        caller's lock: an all-reduce of ours given up on may hold the buffers up to allreduce_timeout).
        They may be read, not written, after the block and until the round."""
        lock = self._locked()
        try:
            yield list(self.averager._averaged_tensors)
        finally:
            lock.release()

    @contextlib.contextmanager
    def round(self, *, weight: float, gather: dict, refused=(),
              cancel: threading.Event | None = None) -> Iterator[RoundResult]:
        """All-reduce what was staged (:meth:`staging`), weighted by ``weight``, with whatever group
        forms; bounded in time. Yields the result, whose ``change`` is the averager's buffers
        themselves: the averager does not touch them until the block ends, then gives their pages back."""
        error: BaseException | None = None
        gathered = None
        try:
            self.averager.set_refused(refused)
            control = self._control = self.averager.step(gather=gather, weight=weight, timeout=self.round_timeout,
                                                         allow_retries=False, wait=False)
            deadline = time.monotonic() + self.round_timeout + self.allreduce_timeout + 5
            while not control.done():
                if (cancel is not None and cancel.is_set()) or time.monotonic() > deadline:
                    control.cancel()
                    break
                time.sleep(0.1)
            if control.done() and not control.cancelled():
                gathered = control.result(timeout=1)
        except Exception as e:  # hivemind raises on broken rounds; the caller's training goes on
            log.info("averaging round failed: %s", e)
            error = e
        try:
            if not gathered:
                if error is not None and REFUSED_GROUP in str(error):
                    raise RoundFailed(str(error)[str(error).index(REFUSED_GROUP):], refused=True)
                raise RoundFailed(f"{type(error).__name__}: {error}" if error is not None else
                                  "no group formed (no same-block peer joined the round)")
            lock = self._locked()
            try:
                stalled, unaveraged = gathered.pop(STALLED_KEY, None) or ((), 0.0)
                yield RoundResult({str(k): v for k, v in gathered.items()}, list(self.averager._averaged_tensors),
                                  tuple(stalled), float(unaveraged))
            finally:
                lock.release()
        finally:
            self._release()

    def _release(self) -> None:
        """Free the averager's buffers between rounds, so a node holds its block once, not twice.
        Nothing reads them then: :meth:`staging` fills them first, and downloaders get the trainer's
        weights (``state``). Kept while a step of ours may still run (a round given up on: its late
        all-reduce must not send zeros to the group)."""
        c = self._control
        if c is not None and not c.done():
            return
        try:
            lock = self._locked()
        except RoundFailed:
            return
        try:
            self.released_bytes = sum(free_shared_pages(s) for s in self.averager._averaged_tensors)
        finally:
            lock.release()

    def _locked(self):
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=self.allreduce_timeout + 5):
            raise RoundFailed("the averager is still busy with an earlier all-reduce")
        return lock

    def shutdown(self) -> bool:
        """Ask the averager process to stop; SIGKILL it after its shutdown timeout. False if it
        had to be killed."""
        a = self.averager
        return stop_process(a, a.shutdown if a.is_alive() else None, timeout=a.shutdown_timeout + 0.5)
