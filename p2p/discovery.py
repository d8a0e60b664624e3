"""Discovery on a hivemind DHT: start/join, run manifest, signed block announcements, holder lists.

Every method exists twice: ``aX()`` is a coroutine for callers inside an event loop (it awaits
hivemind's ``return_future=True`` futures, never blocking the loop); ``X()`` is the blocking form
for threads, run on a private loop thread. Calling a blocking form from inside an event loop
raises ``RuntimeError`` instead of freezing the loop.

Announcements: constant TTL (default 30 s), refreshed every TTL/3 by :meth:`start_announcing`;
``withdraw`` stores a tombstone (``None``, expiring just after the last announcement), and readers
skip tombstones. Readers also drop any announcement whose ``peer_id`` is not the PeerID of the key
that signed it, so a peer cannot advertise itself under someone else's id.

(Over 400 lines on purpose: each operation is here twice, as a coroutine and as its blocking form,
next to each other; what readers believe of raw records lives apart, in ``dht_schema``.)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from blocktrain.p2p.addresses import parse_initial_peers, parse_multiaddr
from blocktrain.p2p.aioloop import LoopThread, in_event_loop
from blocktrain.p2p.dht_schema import (
    block_subkey, blocks_key, live_manifest_entries, make_validators, manifest_key, owner_marker, parse_holders,
    parse_manifests, run_schema_validator,
)
from blocktrain.p2p.dht_guard import guard_storage, refusals
from blocktrain.p2p.errors import (
    ConfigMismatchError, DiscoveryError, IdentityError, IdentityInUseError, ManifestConflictError,
    RecordError, RunNotFoundError,
)
from blocktrain.p2p.identity import NodeIdentity
from blocktrain.p2p.reachability import (
    all_loopback, ask_relayed, circuit_addrs, learn_relayed, private_dht_options, probe_reachability, serve_dial_back,
)
from blocktrain.p2p.inprocess import RunsInThread, hivemind_in
from blocktrain.p2p.process import DroppingPipe, StopsWithParent, detach_spawned_daemons, stop_process
from blocktrain.p2p.records import PROTOCOL_VERSION, BlockAnnouncement, RunManifest, validate_run_id
from blocktrain.p2p.runtime_dir import use_runtime_dir

__all__ = [
    "Discovery", "DEFAULT_TTL", "MANIFEST_COPIES", "ConfigMismatchError", "RunNotFoundError",
    "ManifestConflictError",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TTL = 30.0  # seconds an announcement lives without refresh
MANIFEST_COPIES = 3   # believable stores of a run's manifest members keep alive beside the seeder's (keep_manifest)
TOMBSTONE_DELAY = 1e-3  # a tombstone expires this long after the record it replaces
DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
MAX_RELAYS_ASKED = 6   # relays a private node asks per check whether they carry dials to it

AnnGetter = Callable[[], BlockAnnouncement | Sequence[BlockAnnouncement] | None]


# -- functions executed inside the DHT process (must be top-level to pickle) --------------------
async def _add_validators(_dht: DHT, node: DHTNode, validators: list[Any]) -> None:
    node.protocol.record_validator.extend(validators)


async def _visible_maddrs(_dht: DHT, node: DHTNode) -> list[str]:
    return [str(m) for m in await node.p2p.get_visible_maddrs()]


class _NodeDHT(RunsInThread, StopsWithParent, DHT):
    """hivemind's DHT loop in a thread of the node's process (p2p/inprocess.py, the default), or as
    the node's child process (``BT_HIVEMIND_IN=process``; p2p/process.py: it ignores SIGINT/SIGTERM
    and exits on its own when the node dies; requests from processes that have exited are dropped,
    :class:`~blocktrain.p2p.process.DroppingPipe`). Either way p2pd starts in its own session and
    exits when the DHT's loop (the thread or process that started it) ends."""

    bt_spawns_daemons = True

    def run(self) -> None:   # in the DHT's thread or process
        if not self.bt_in_thread:   # a thread's local pipe has no sender that can exit
            self._inner_pipe = DroppingPipe(self._inner_pipe, "_bt_dropped")
        super().run()

    def bt_use_thread(self) -> None:
        detach_spawned_daemons()   # in this process: the loop thread spawns p2pd here
        super().bt_use_thread()
        self._bt_replicas: dict = {}

    async def replicate_p2p(self):
        """hivemind keeps one replica per *process*; in-process loops (the node's RPC loop, the
        averager's) each need their own, bound to their own event loop."""
        if not self.bt_in_thread:
            return await super().replicate_p2p()
        from hivemind.p2p import P2P
        loop = asyncio.get_running_loop()
        replica = self._bt_replicas.get(loop)
        if replica is None:
            maddr = self.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
            replica = self._bt_replicas[loop] = await P2P.replicate(maddr)
        return replica

    def bt_close_replicas(self, timeout: float = 2.0) -> None:
        """Shut down the replicas :meth:`replicate_p2p` made (hivemind never does: each kept its client
        socket file until the process exited), each on its own loop while that loop runs."""
        replicas, self._bt_replicas = getattr(self, "_bt_replicas", {}), {}
        for loop, replica in replicas.items():
            try:
                if loop.is_running() and not loop.is_closed() and not _running_in(loop):
                    asyncio.run_coroutine_threadsafe(replica.shutdown(), loop).result(timeout)
            except Exception as e:   # stopping anyway
                logger.debug("closing a P2P replica: %s", e)
            finally:
                with contextlib.suppress(Exception):
                    os.remove(replica._client_listen_maddr["unix"])

    async def _bt_dropped(self) -> None:
        return None


def _running_in(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


BOOTSTRAP_ATTEMPTS = 5        # DHT starts through initial peers that did not answer a ping in time
DHT_SHUTDOWN_TIMEOUT = 2.0   # seconds the DHT process gets to stop (p2pd with it) before SIGKILL


class Discovery:
    """A hivemind DHT plus BlockTrain's record conventions. Create with :meth:`start`."""

    def __init__(self, dht: DHT, record_key: RSAPrivateKey, *, ttl: float = DEFAULT_TTL):
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.dht = dht
        self.record_key = record_key
        self.ttl = float(ttl)
        self.peer_id: str = str(dht.peer_id)
        self.public_key: str = record_key.get_public_key().to_bytes().decode()
        self._followed: set[str] = set()
        self._run_hash: dict[str, str] = {}
        self._seeder: dict[str, str] = {}          # run -> the seeder whose manifest this node trusts
        self._last_exp: dict[tuple[str, int], float] = {}  # highest expiration ever sent per (run, block)
        self._active: set[tuple[str, int]] = set()  # slots announced and not withdrawn
        self._loop = LoopThread(name=f"bt-discovery-{self.peer_id[-6:]}")
        self._announce_task: asyncio.Task[None] | None = None
        self._owned_identity: NodeIdentity | None = None
        self._closed = False
        self.reachability = "client" if dht.client_mode else "public"   # start() may say "private"
        self.relays: list[str] = []     # private: its initial peers, those that answered first (its static relays)
        self.live_relays: list[str] = []   # private: the relays its last check found carrying dials to it

    # -- lifecycle --------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        *,
        identity: NodeIdentity | None = None,
        initial_peers: Iterable[str] = (),
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        announce_maddrs: Sequence[str] | None = None,
        client_mode: bool = False,
        run_ids: Iterable[str] = (),
        ttl: float = DEFAULT_TTL,
        startup_timeout: float = 60.0,
        reachability: str = "assume-public",
        **dht_kwargs: Any,
    ) -> "Discovery":
        """Start a DHT node (a new network if ``initial_peers`` is empty, else join through them).

        ``identity`` fixes the PeerID and the record-signing key; without it a throw-away RSA identity
        is made (so the PeerID still matches the signing key, which readers check).
        ``run_ids`` are the runs whose record schemas this node enforces from the start (more can
        be added later; every method taking a run id follows that run automatically).
        ``reachability="auto"``: first ask the initial peers to dial this node back (p2p/reachability.py);
        if none can, start as a *private* node (DHT/averager client mode, autorelay through the initial
        peers) and set ``self.reachability = "private"``. Public nodes answer others' dial-back requests.
        """
        in_thread = hivemind_in() == "thread"   # a bad BT_HIVEMIND_IN is refused before anything starts
        use_runtime_dir()   # hivemind's unix sockets in a directory removed at exit (p2p/runtime_dir.py)
        peers = parse_initial_peers(list(initial_peers))
        hosts = [parse_multiaddr(m) for m in host_maddrs]
        announce = [parse_multiaddr(m, allow_port_zero=False) for m in announce_maddrs] if announce_maddrs else None
        runs = [validate_run_id(r) for r in run_ids]
        if reachability not in ("auto", "assume-public"):
            raise ValueError(f"reachability must be 'auto' or 'assume-public', got {reachability!r}")
        private, answered = False, []
        if reachability == "auto" and peers and not client_mode and not all_loopback([*hosts, *peers]):
            reachable, hosts, answered = asyncio.run(probe_reachability(peers, hosts, announce))
            private = reachable is False
            if reachable is None:
                logger.warning("no initial peer could check whether others can dial this node; assuming they can")
        owned = identity is None
        ident = NodeIdentity.ephemeral() if identity is None else identity
        key = ident.record_key
        kwargs: dict[str, Any] = dict(dht_kwargs)
        kwargs["identity_path"] = ident.identity_path
        if owned:  # a key made a moment ago cannot be in use elsewhere: skip hivemind's probe (a second p2pd)
            kwargs.setdefault("check_if_identity_free", False)
        if announce:
            kwargs["announce_maddrs"] = announce
        if private:
            kwargs.update(private_dht_options(answered))   # they answered: alive, public, relays
            client_mode = kwargs.pop("client_mode")
        kwargs.setdefault("shutdown_timeout", DHT_SHUTDOWN_TIMEOUT)
        deadline = time.monotonic() + startup_timeout
        for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
            dht = _NodeDHT(
                initial_peers=peers or None,
                start=False,
                host_maddrs=hosts,
                client_mode=client_mode,
                record_validators=make_validators(key, runs),
                **kwargs,
            )
            if in_thread:
                dht.bt_use_thread()
            try:
                dht.run_in_background(await_ready=True, timeout=max(1.0, deadline - time.monotonic()))
                break
            except BaseException as e:
                _kill_dht(dht)
                # a peer that did not answer a ping in time (a busy machine, a peer still starting):
                # try again with a fresh DHT while the start-up time lasts
                retry = (isinstance(e, Exception) and peers and "bootstrap" in str(e)   # hivemind's and p2pd's words
                         and attempt < BOOTSTRAP_ATTEMPTS and time.monotonic() + 2.0 * attempt < deadline)
                if retry:
                    logger.warning("DHT bootstrap through %s failed (attempt %d of %d), retrying: %s",
                                   peers, attempt, BOOTSTRAP_ATTEMPTS, e)
                    time.sleep(2.0 * attempt)
                    continue
                if owned:
                    ident.close()
                if not isinstance(e, Exception):
                    raise
                if "already taken" in str(e):
                    raise IdentityInUseError(
                        f"identity {ident.identity_path} (peer {ident.peer_id}) is already used by a live node of "
                        f"this network; give this node its own identity/data directory"
                    ) from e
                skew = clock_skew(e)
                if skew is not None:
                    raise DiscoveryError(
                        f"this machine's clock is {abs(skew):.0f} s {'behind' if skew < 0 else 'ahead of'} its initial "
                        f"peers' (the DHT accepts 3 s): set the time (turn on NTP, e.g. `timedatectl set-ntp true`) "
                        f"and start again") from e
                where = f"through initial peers {peers}" if peers else f"on {hosts}"
                raise DiscoveryError(f"could not start a DHT node {where}: {type(e).__name__}: {e}") from e
        self = cls(dht, key, ttl=ttl)
        self.bootstrap_attempts = attempt   # DHT starts it took (more than 1: its initial peers answered late)
        if owned:
            self._owned_identity = ident
        if self.peer_id != ident.peer_id:
            self.shutdown(withdraw=False)
            raise IdentityError(f"the DHT runs as {self.peer_id} but identity {ident.identity_path} is {ident.peer_id}")
        dht.run_coroutine(guard_storage)   # what other peers may make this node's DHT keep (dht_guard.py)
        self._followed.update(runs)
        if private:
            self.reachability, self.relays = "private", list(dict.fromkeys([*answered, *peers]))
        elif not client_mode:
            dht.run_coroutine(serve_dial_back)
        return self

    def storage_refusals(self) -> dict[str, int]:
        """Records other peers asked this node's DHT to keep and it refused, by reason (dht_guard.py)."""
        try:
            return self.dht.run_coroutine(refusals)
        except Exception as e:   # a DHT that is stopping: nothing to report
            logger.debug("reading the DHT's refusals: %s", e)
            return {}

    def shutdown(self, *, withdraw: bool = True, timeout: float = 15.0) -> bool:
        """Stop refreshing, optionally leave tombstones (waiting up to ``timeout`` s), stop the DHT
        process (and p2pd) and the loop thread (idempotent). False if the DHT process did not stop
        when asked and had to be killed (p2pd gone first, say)."""
        if self._closed:
            return True
        self._closed = True
        clean = False
        try:
            self._loop.run(self._astop_announcing(withdraw=withdraw), timeout=timeout)
        except Exception as e:  # shutting down anyway
            logger.warning("withdrawing announcements during shutdown failed: %s", e)
        finally:
            clean = _kill_dht(self.dht)
            self._loop.stop()
            if self._owned_identity is not None:
                self._owned_identity.close()
        return clean

    def __enter__(self) -> "Discovery":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- plumbing ---------------------------------------------------------------------------
    def _sync(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        if in_event_loop():
            coro.close()
            raise RuntimeError(f"Discovery.{name}() blocks; inside an event loop use `await Discovery.a{name}()`")
        return self._loop.run(coro)

    async def afollow_run(self, run_id: str) -> None:
        """Enforce ``run_id``'s record schemas on this node (idempotent)."""
        validate_run_id(run_id)
        if run_id in self._followed:
            return
        await self.dht.run_coroutine(partial(_add_validators, validators=[run_schema_validator(run_id)]),
                                     return_future=True)
        self._followed.add(run_id)

    def follow_run(self, run_id: str) -> None:
        self._sync(self.afollow_run(run_id), "follow_run")

    async def avisible_maddrs(self) -> list[str]:
        return list(await self.dht.run_coroutine(_visible_maddrs, return_future=True))

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<peer id>) other nodes can use as initial peers."""
        return self._sync(self.avisible_maddrs(), "visible_maddrs")

    def relay_addresses(self) -> list[str]:
        """A private node's circuit addresses, through the relays its last check found carrying
        dials to it; empty for a public node."""
        return circuit_addrs(self.live_relays, self.peer_id)

    def check_relayed(self, candidates: Sequence[str] = ()) -> list[str]:
        """A private node: which relays (its initial peers, then ``candidates``: multiaddrs with
        /p2p/ of public peers) carry a fresh dial to it now. Remembered for :meth:`relay_addresses`."""
        if self.reachability != "private":
            return []
        relays = [r for r in dict.fromkeys([*self.relays, *candidates]) if "/p2p-circuit" not in r][:MAX_RELAYS_ASKED]
        self.live_relays = list(self._sync(self._acheck_relayed(relays), "check_relayed"))
        return list(self.live_relays)

    async def _acheck_relayed(self, relays: list[str]) -> list[str]:
        return await self.dht.run_coroutine(partial(ask_relayed, relays=relays), return_future=True)

    # -- manifest ---------------------------------------------------------------------------
    async def apublish_manifest(self, manifest: RunManifest) -> None:
        if manifest.seeder_public_key != self.public_key:
            raise RecordError(
                "manifest.seeder_public_key is not this node's record key; only the seeder can publish "
                "(set seeder_public_key=discovery.public_key)"
            )
        await self.afollow_run(manifest.run_id)
        ok = await self.dht.store(
            manifest_key(manifest.run_id), manifest.to_wire(), get_dht_time() + manifest.ttl_s,
            subkey=owner_marker(self.record_key), return_future=True,
        )
        if not ok:
            raise DiscoveryError(f"storing the manifest of run {manifest.run_id!r} was refused by every DHT node")
        self.trust(manifest)

    def publish_manifest(self, manifest: RunManifest) -> None:
        """Publish the run manifest signed by this node's key (the node becomes the run's seeder); this
        store lives the manifest's ``ttl_s``."""
        self._sync(self.apublish_manifest(manifest), "publish_manifest")

    async def akeep_manifest(self, manifest: RunManifest, *, copies: int = MANIFEST_COPIES) -> str:
        """Keep ``manifest`` in the DHT; call it every ``manifest.ttl_s / 4`` or so.

        The seeder re-stores its record with a fresh lifetime (a record lives ``ttl_s`` after its last
        store, and only on the DHT nodes that took it: both go without a refresh). Any other member
        stores a copy under its own subkey when fewer than ``copies`` believable stores of it (the
        seeder's and copies whose seeder signature verifies) have more than half their lifetime left,
        so the run stays joinable after its seeder leaves. Returns "stored", "copied", "enough",
        "unsigned" (a manifest without the seeder's signature is not copied) or "refused"."""
        if manifest.seeder_public_key == self.public_key:
            await self.apublish_manifest(manifest)
            return "stored"
        if not manifest.signature_ok():
            return "unsigned"
        await self.afollow_run(manifest.run_id)
        key = manifest_key(manifest.run_id)
        found = await self.dht.get(key, latest=True, return_future=True)
        live = live_manifest_entries(manifest.run_id, found, manifest.seeder_public_key,
                                     after=get_dht_time() + manifest.ttl_s / 2)
        if live >= copies:
            return "enough"
        ok = await self.dht.store(key, manifest.to_wire(), get_dht_time() + manifest.ttl_s,
                                  subkey=owner_marker(self.record_key), return_future=True)
        return "copied" if ok else "refused"

    def keep_manifest(self, manifest: RunManifest, *, copies: int = MANIFEST_COPIES) -> str:
        return self._sync(self.akeep_manifest(manifest, copies=copies), "keep_manifest")

    async def aclaimants(self, run_id: str) -> list[RunManifest]:
        """Every well-formed manifest published under ``run_id``, one per seeder key, oldest claim first."""
        await self.afollow_run(run_id)
        found = await self.dht.get(manifest_key(run_id), latest=True, return_future=True)
        return sorted(parse_manifests(run_id, found, None), key=lambda m: (m.created_at, m.seeder_public_key))

    def claimants(self, run_id: str) -> list[RunManifest]:
        return self._sync(self.aclaimants(run_id), "claimants")

    def trust(self, manifest: RunManifest) -> None:
        """From now on, read ``manifest``'s run through its seeder: its config hash decides which
        announcements count, and later manifest reads are pinned to that seeder."""
        self._run_hash[manifest.run_id] = manifest.config_hash
        self._seeder[manifest.run_id] = manifest.seeder

    async def aget_manifest(self, run_id: str, *, seeder: str | None = None) -> RunManifest | None:
        seeder = seeder or self._seeder.get(run_id)
        manifests = await self.aclaimants(run_id)
        if seeder is not None:
            manifests = [m for m in manifests if m.seeder == seeder]
        if not manifests:
            return None
        if len(manifests) > 1:   # a claim's timestamp is the writer's own word: it decides nothing
            listing = "; ".join(f"{m.seeder} (config {m.config_hash}, data {m.data_spec})" for m in manifests)
            raise ManifestConflictError(
                f"run {run_id!r} is claimed by {len(manifests)} seeders: {listing}. Ask the run's organiser for "
                f"its run address and pass it as --run {run_id}@SEEDER_PEER_ID"
            )
        return manifests[0]

    def get_manifest(self, run_id: str, *, seeder: str | None = None) -> RunManifest | None:
        """The run's manifest (by ``seeder`` if given), None if nobody published one; ManifestConflictError
        if several seeders claim the run and none is pinned."""
        return self._sync(self.aget_manifest(run_id, seeder=seeder), "get_manifest")

    async def acheck_manifest(
        self, run_id: str, config_hash: str, *, seeder: str | None = None,
        protocol_version: int = PROTOCOL_VERSION,
    ) -> RunManifest:
        m = await self.aget_manifest(run_id, seeder=seeder)
        if m is None:
            raise RunNotFoundError(
                f"no manifest is published for run {run_id!r}: check the run id and that the initial peers "
                f"belong to that run's network (or seed the run first)"
            )
        if m.config_hash != config_hash:
            raise ConfigMismatchError(
                f"run {run_id!r} uses config hash {m.config_hash} but this node's config hashes to {config_hash}; "
                f"refusing to join. Start the node with the run's model config."
            )
        if m.protocol_version != protocol_version:
            raise ConfigMismatchError(
                f"run {run_id!r} speaks wire protocol v{m.protocol_version} but this node speaks "
                f"v{protocol_version}; upgrade/downgrade blocktrain to match"
            )
        self._run_hash[run_id] = m.config_hash
        return m

    def check_manifest(
        self, run_id: str, config_hash: str, *, seeder: str | None = None,
        protocol_version: int = PROTOCOL_VERSION,
    ) -> RunManifest:
        """Return the manifest if this node may join; raise RunNotFoundError / ConfigMismatchError otherwise."""
        return self._sync(
            self.acheck_manifest(run_id, config_hash, seeder=seeder,
                                 protocol_version=protocol_version),
            "check_manifest",
        )

    # -- announcements ----------------------------------------------------------------------
    async def aannounce(self, ann: BlockAnnouncement) -> bool:
        if ann.peer_id != self.peer_id:
            raise RecordError(
                f"announcement names peer {ann.peer_id} but this node is {self.peer_id}; readers would drop it"
            )
        await self.afollow_run(ann.run_id)
        slot = (ann.run_id, ann.block_index)
        expiration = max(get_dht_time() + self.ttl, self._last_exp.get(slot, 0.0) + TOMBSTONE_DELAY)
        # remember the attempt before awaiting: a later tombstone must outrank even a store still in flight
        self._last_exp[slot] = expiration
        self._active.add(slot)
        ok = await self.dht.store(
            blocks_key(ann.run_id), ann.to_wire(), expiration,
            subkey=block_subkey(ann.block_index, self.record_key), return_future=True,
        )
        if not ok:
            logger.warning("announcement of block %d in run %s was not stored", ann.block_index, ann.run_id)
        return bool(ok)

    def announce(self, ann: BlockAnnouncement) -> bool:
        """Store (or refresh) this node's announcement for ``ann.block_index``; expires after TTL."""
        return self._sync(self.aannounce(ann), "announce")

    async def awithdraw(self, run_id: str | None = None, block_index: int | None = None) -> int:
        await self._acancel_refresher()
        slots = sorted(s for s in self._active
                       if (run_id is None or s[0] == run_id) and (block_index is None or s[1] == block_index))
        stored = 0
        for rid, b in slots:
            expiration = max(self._last_exp[(rid, b)], get_dht_time()) + TOMBSTONE_DELAY
            self._last_exp[(rid, b)] = expiration
            ok = await self.dht.store(blocks_key(rid), None, expiration, subkey=block_subkey(b, self.record_key),
                                      return_future=True)
            if ok:
                stored += 1
                self._active.discard((rid, b))
            else:
                logger.warning("tombstone for block %d in run %s was not stored", b, rid)
        return stored

    def withdraw(self, run_id: str | None = None, block_index: int | None = None) -> int:
        """Replace this node's announcements (all, or those matching) by tombstones; returns how many.

        Also stops :meth:`start_announcing`'s refresher, which would otherwise re-announce them.
        """
        return self._sync(self.awithdraw(run_id, block_index), "withdraw")

    async def _acancel_refresher(self) -> None:
        if self._announce_task is None:
            return
        if asyncio.get_running_loop() is self._loop.loop:
            await self._astop_announcing(withdraw=False)
        else:
            await asyncio.wrap_future(self._loop.submit(self._astop_announcing(withdraw=False)))

    def start_announcing(self, getter: AnnGetter, *, interval: float | None = None,
                         first_timeout: float = 15.0) -> None:
        """Announce ``getter()`` now and every ``interval`` (default TTL/3) until :meth:`stop_announcing`.

        ``getter`` runs in a worker thread and returns one announcement, several, or None (skip).
        Returns once the first announcement is stored (or failed, or ``first_timeout`` s passed): a node
        that says it is ready is then findable, not hidden behind the tombstone it left last time.
        """
        period = self.ttl / 3 if interval is None else float(interval)
        if period <= 0 or period >= self.ttl:
            raise ValueError(f"refresh interval must be in (0, ttl={self.ttl}), got {period}")
        self._loop.run(self._astart_announcing(getter, period, first_timeout))

    async def _astart_announcing(self, getter: AnnGetter, period: float, first_timeout: float) -> None:
        if self._announce_task is not None and not self._announce_task.done():
            raise RuntimeError("already announcing; call stop_announcing() first")
        first = asyncio.Event()
        self._announce_task = asyncio.create_task(self._announce_forever(getter, period, first))
        try:
            await asyncio.wait_for(first.wait(), first_timeout)
        except asyncio.TimeoutError:
            logger.warning("the first announcement took over %.0fs; going on (it keeps trying)", first_timeout)

    async def _announce_forever(self, getter: AnnGetter, period: float, first: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                got = await loop.run_in_executor(None, getter)
                anns = [] if got is None else [got] if isinstance(got, BlockAnnouncement) else list(got)
                for a in anns:
                    await self.aannounce(a)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("periodic announcement failed (will retry in %.1fs): %s", period, e)
            first.set()
            await asyncio.sleep(period)

    async def _astop_announcing(self, *, withdraw: bool) -> None:
        task, self._announce_task = self._announce_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if withdraw:
            await self.awithdraw()

    def stop_announcing(self, *, withdraw: bool = True, timeout: float | None = None) -> None:
        """Stop the refresher; with ``withdraw`` also store tombstones for everything announced
        (waiting up to ``timeout`` s for the stores; None: as long as they take)."""
        self._loop.run(self._astop_announcing(withdraw=withdraw), timeout=timeout)

    # -- reading ----------------------------------------------------------------------------
    async def _aexpected_hash(self, run_id: str, config_hash: str | None) -> str:
        if config_hash is not None:
            return config_hash
        if run_id not in self._run_hash:
            m = await self.aget_manifest(run_id)
            if m is None:
                raise RunNotFoundError(f"no manifest is published for run {run_id!r}, so its config hash is unknown")
            self._run_hash[run_id] = m.config_hash
        return self._run_hash[run_id]

    async def alist_holders(self, run_id: str, config_hash: str | None = None) -> dict[int, list[BlockAnnouncement]]:
        await self.afollow_run(run_id)
        expected = await self._aexpected_hash(run_id, config_hash)
        found = await self.dht.get(blocks_key(run_id), latest=True, return_future=True)
        holders = parse_holders(run_id, found, expected)
        relayed = {a.peer_id: a.addresses for anns in holders.values() for a in anns
                   if a.peer_id != self.peer_id and any("/p2p-circuit/" in m for m in a.addresses)}
        if relayed:   # members behind NAT announce circuit addresses: let our daemon know them
            await self.dht.run_coroutine(partial(learn_relayed, peers=relayed), return_future=True)
        return holders

    def list_holders(self, run_id: str, config_hash: str | None = None) -> dict[int, list[BlockAnnouncement]]:
        """Live holders per block: signed by the peer they name, not tombstoned, state joining/online,
        matching ``config_hash`` (default: the run manifest's)."""
        return self._sync(self.alist_holders(run_id, config_hash), "list_holders")


_SKEW = re.compile(r"local time must be within .*?local: ([0-9.]+), peer: ([0-9.]+)", re.S)


def clock_skew(e: BaseException) -> float | None:
    """Seconds this machine's clock is ahead of a peer's (negative: behind), read from hivemind's refusal
    to bootstrap with a peer whose time differs by more than its 3 s; None for any other error."""
    m = _SKEW.search(str(e))
    return float(m.group(1)) - float(m.group(2)) if m else None


def _kill_dht(dht: DHT) -> bool:
    """Ask the DHT process to stop (it stops p2pd), then SIGKILL it if it has not within its
    shutdown timeout (it ignores SIGTERM, see p2p/process.py). False if it had to be killed."""
    if isinstance(dht, _NodeDHT):
        dht.bt_close_replicas()
    return stop_process(dht, dht.shutdown, timeout=dht.shutdown_timeout + 0.5)
