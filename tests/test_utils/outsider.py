"""An outsider attacking a BlockTrain run with a plain hivemind peer: no BlockTrain code, only
hivemind and what anyone can read off the wire (key names, record fields, handler names).

    python tests/test_utils/outsider.py --initial-peer MADDR

Speaks the JSON-lines protocol of ``wire_procs.NodeProc``: prints ``{"event": "ready", ...}``, then
answers one JSON line per command on stdin:

* ``forge_manifest``: store a manifest for an existing run id, signed by the outsider's own key
  (so it is a well-formed claim by a second seeder), with ``created_at`` 1.0 and any data spec;
* ``fake_runs``: write entries under the old run-index key and a manifest for a fake run;
* ``sybils``: N fresh RSA identities announce themselves as holders of one block (valid
  signatures, claimed throughput 10^6 samples/s); ``stall`` of them run a real p2p daemon that
  accepts the block's hop streams and state downloads (or, ``stall_kind="train"``, its pipeline micro-batches) and never
  answers, the rest list an address nobody answers on; with ``offer_file`` (a ``torch.save``d dict of
  named tensors) the daemons answer state downloads with those tensors instead, well-formed on the
  wire, claiming 10^9 steps (hops still stall);
* ``poison_upstream``: announce this peer as an online holder of block b-1 (its own key and daemon: a Sybil
  holder), then send a holder of block b N well-formed micro-batches whose targets are all one byte;
* ``taken``: how many requests the stalling daemons have taken (and held) so far;
* ``quit``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import threading
import time
from functools import partial
from typing import AsyncIterator  # hivemind reads the handlers' type hints

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import crypto_pb2, runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time


def owner(key: RSAPrivateKey) -> bytes:
    return b"[owner:" + key.get_public_key().to_bytes() + b"]"


def peer_id_of(key: RSAPrivateKey) -> str:
    """libp2p's peer id of an RSA key (hivemind's own PeerID.from_identity over the key protobuf)."""
    from cryptography.hazmat.primitives import serialization
    der = key._private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                         serialization.NoEncryption())
    return PeerID.from_identity(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()).to_base58()


class ManyKeysSigner(RecordValidatorBase):
    """Signs each record with whichever of our keys its subkey names (each identity signs its own
    records, as hivemind's RSASignatureValidator does for one key); accepts everything it reads."""

    def __init__(self, keys: list[RSAPrivateKey]):
        self.by_marker = {owner(k): RSASignatureValidator(k) for k in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        for marker, v in self.by_marker.items():
            if marker in record.key or marker in record.subkey:
                return v.sign_value(record)
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return RSASignatureValidator.strip_value(next(iter(self.by_marker.values())), record)

    def validate(self, record: DHTRecord) -> bool:
        return True

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other) -> bool:
        return False


_TAKEN = [0]   # per staller process: requests taken and held
_OFFER: dict = {}   # per staller process with an offer: name -> tensor it serves as the block's state
_OFFER_META: dict = {}   # and the config hash it claims for it
WIRE_VERSION, CHUNK = 1, 1 << 20   # the block RPC's wire version and its streamed part size, as read off the wire


async def _taken(_dht, node) -> int:   # runs in a staller's DHT process
    return _TAKEN[0]


class BlockService(ServicerBase):
    """Named like the holders' servicer, so hivemind routes the block's hops and state downloads here; never answers."""

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        _TAKEN[0] += 1
        await asyncio.sleep(3600)
        return runtime_pb2.ExpertResponse()

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                 ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        _TAKEN[0] += 1
        await asyncio.sleep(3600)
        yield runtime_pb2.ExpertResponse()

    async def rpc_state(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                        ) -> AsyncIterator[runtime_pb2.ExpertResponse]:   # a state download: taken, never answered
        _TAKEN[0] += 1
        if not _OFFER:
            await asyncio.sleep(3600)
            yield runtime_pb2.ExpertResponse()
            return
        rid = json.loads(request.metadata).get("request_id", "")   # a well-formed answer: metadata, then parts
        head = {"v": WIRE_VERSION, "ok": True, "request_id": rid, "names": list(_OFFER),
                "meta": {"step": 10 ** 9, "samples_seen": 10 ** 9, "config_hash": _OFFER_META["config_hash"]}}
        yield runtime_pb2.ExpertResponse(metadata=json.dumps(head).encode())
        for t in _OFFER.values():
            buf = t.contiguous().numpy().tobytes()
            chunks = max(1, -(-len(buf) // CHUNK))
            yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(
                buffer=buf[:CHUNK], size=list(t.shape), dtype="float32", compression=runtime_pb2.CompressionType.NONE,
                chunks=chunks)])
            for start in range(CHUNK, len(buf), CHUNK):
                yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=buf[start:start + CHUNK])])


class PipelineService(ServicerBase):
    """Named like the holders' pipeline servicer, so hivemind routes the block's micro-batches here; never answers."""

    async def rpc_train(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                        ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for _ in requests:   # takes the micro-batch, then holds it
            pass
        _TAKEN[0] += 1
        await asyncio.sleep(3600)
        yield runtime_pb2.ExpertResponse()


STALLERS = {"hop": (BlockService, "bt_{run}_b{block}"), "train": (PipelineService, "bt_{run}_t{block}")}


async def _add_signer(_dht, node, signer: ManyKeysSigner) -> None:   # runs in the DHT's process
    node.protocol.record_validator.extend([signer])


async def _serve_stalling(_dht, node, namespace: str, kind: str = "hop", offer_file: str | None = None,
                          config_hash: str = "") -> None:   # in the staller's DHT process
    if offer_file is not None:
        import torch
        _OFFER.update({k: v.detach().to(torch.float32) for k, v in torch.load(offer_file).items()})
        _OFFER_META["config_hash"] = config_hash
    await STALLERS[kind][0]().add_p2p_handlers(node.p2p, namespace=namespace)


async def _send_microbatches(_dht, node, namespace: str, holder: str, block: int, n: int, shape: list[int],
                             target: int, seed: int, batches_file: str | None = None) -> dict:
    """In the outsider's DHT process: ``n`` well-formed ``rpc_train`` micro-batches to ``holder``, each random
    activations (N, T, D) and targets all byte ``target`` (or, with ``batches_file``, the i-th of the
    ``torch.save``d list of (activations, byte targets) pairs it holds), written as read off the wire (JSON
    metadata, raw little-endian tensors); the answers' codes counted ("ok" for a trained one). Answers
    ``not_upstream`` (the holder's view of the DHT does not list us yet) are retried for up to 60 s, not counted."""
    import torch
    N, T, D = shape
    g = torch.Generator().manual_seed(seed)
    prepared = torch.load(batches_file) if batches_file else None
    stub = PipelineService.get_stub(node.p2p, PeerID.from_base58(holder), namespace=namespace)
    codes: dict[str, int] = {}
    deadline = time.monotonic() + 60
    i = 0
    while i < n:
        acts = torch.randn(N, T, D, generator=g)
        targets = bytes([target]) * (N * T)
        if prepared is not None:
            acts = prepared[i % len(prepared)][0].to(torch.float32).contiguous()
            targets = prepared[i % len(prepared)][1].to(torch.uint8).contiguous().numpy().tobytes()
            N, T, D = acts.shape
        meta = {"v": WIRE_VERSION, "request_id": f"poison-{i}-{time.monotonic_ns()}", "block_index": block,
                "mode": "backprop", "codec": "fp32", "deadline_s": 20.0}
        msg = runtime_pb2.ExpertRequest(metadata=json.dumps(meta).encode(), tensors=[
            runtime_pb2.Tensor(buffer=acts.numpy().tobytes(), size=[N, T, D], dtype="float32",
                               compression=runtime_pb2.CompressionType.NONE),
            runtime_pb2.Tensor(buffer=targets, size=[N, T], dtype="uint8",
                               compression=runtime_pb2.CompressionType.NONE)])

        async def parts():
            yield msg
        first = None
        async for answer in await stub.rpc_train(parts()):
            first = first or json.loads(answer.metadata)
        code = "ok" if first.get("ok") else str(first.get("code"))
        if code == "not_upstream" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            continue
        codes[code] = codes.get(code, 0) + 1
        i += 1
    return codes


def reply(obj) -> None:
    print(json.dumps(obj), flush=True)


class Outsider:
    def __init__(self, initial_peer: str):
        self.initial_peer = initial_peer
        self.key = RSAPrivateKey()
        self.signer = ManyKeysSigner([self.key])
        self.dht = DHT(initial_peers=[initial_peer], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       record_validators=[self.signer])
        self.stallers: list[DHT] = []
        self._refresh: threading.Thread | None = None
        self._stop = threading.Event()
        self._key_dir = tempfile.mkdtemp(prefix="outsider-keys-")   # the stallers' identities, removed by close()

    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def forge_manifest(self, run_id: str, data_spec: str, created_at: float = 1.0, config_hash: str | None = None,
                       model_config: dict | None = None) -> bool:
        key = f"{run_id}_manifest"
        honest = self.dht.get(key, latest=True)
        value = None
        if honest is not None and isinstance(honest.value, dict):   # copy the honest claim's fields
            for item in honest.value.values():
                if isinstance(item.value, dict):
                    value = dict(item.value)
                    break
        if value is None:
            value = {"run_id": run_id, "model_config": model_config or {}, "config_hash": config_hash or "0" * 16,
                     "target_seed": 0, "protocol_version": 1}
        value.update(data_spec=data_spec, created_at=float(created_at),
                     seeder_public_key=self.key.get_public_key().to_bytes().decode())
        if config_hash is not None:
            value["config_hash"] = config_hash
        return bool(self.dht.store(key, value, get_dht_time() + 3600, subkey=owner(self.key)))

    def forge_manifest_copy(self, run_id: str, changes: dict) -> bool:
        """A "copy" of the run's manifest under this peer's own subkey, as members keep them, but with
        ``changes`` made to it: it still names the real seeder's key and carries its signature."""
        honest = self.dht.get(f"{run_id}_manifest", latest=True)
        items = [i.value for i in honest.value.values() if isinstance(i.value, dict)] if honest is not None else []
        if not items:
            return False
        value = {**items[0], **changes}
        return bool(self.dht.store(f"{run_id}_manifest", value, get_dht_time() + 3600, subkey=owner(self.key)))

    def fake_runs(self, fake_run: str) -> dict:
        entry = {"run_id": fake_run, "config_hash": "0123456789abcdef", "created_at": 1.0}
        index = self.dht.store("blocktrain_runs", entry, get_dht_time() + 3600, subkey=fake_run.encode() + owner(self.key))
        m = self.forge_manifest(fake_run, "wikitext-2", config_hash="0123456789abcdef")
        return {"index": bool(index), "manifest": m}

    def sybils(self, run_id: str, block: int, config_hash: str, n: int, stall: int = 0, stall_kind: str = "hop",
               offer_file: str | None = None) -> dict:
        """``n`` holder records of ``block`` under fresh keys; the first ``stall`` of them real daemons whose handler
        (hop: ``stall_kind="hop"``; micro-batches: ``"train"``) takes a request and never answers, or with
        ``offer_file`` answers state downloads with the tensors in that file."""
        keys = [RSAPrivateKey() for _ in range(n)]
        # the DHT runs in its own process: hand it signers holding the new keys, a few keys per
        # message (hivemind's pipe to its DHT process fails on messages larger than the pipe buffer)
        for i in range(0, len(keys), 4):
            self.dht.run_coroutine(partial(_add_signer, signer=ManyKeysSigner(keys[i:i + 4])))
        stall_addrs = {}
        for k in keys[:stall]:   # a real daemon under that identity, whose hop handler never answers
            d = self._daemon_of(k)
            d.run_coroutine(partial(_serve_stalling, kind=stall_kind, offer_file=offer_file, config_hash=config_hash,
                                    namespace=STALLERS[stall_kind][1].format(run=run_id, block=block)))
            stall_addrs[peer_id_of(k)] = [str(m) for m in d.get_visible_maddrs()]
        records = []
        for k in keys:
            pid = peer_id_of(k)
            records.append((k, {
                "peer_id": pid, "block_index": block, "state": "online", "step": 10 ** 9, "samples_seen": 10 ** 9,
                "throughput": 1e6, "loss": 0.01, "last_round_time": time.time(), "serving": True,
                "addresses": stall_addrs.get(pid, [f"/ip4/127.0.0.1/tcp/1/p2p/{pid}"]),
                "software_version": "blocktrain/0.1.0", "config_hash": config_hash, "run_id": run_id}))

        first_round = {}
        done = threading.Event()

        def announce_forever():   # the only thread that uses the DHT from here on (its pipe is not thread-safe)
            while not self._stop.is_set():
                stored = 0
                for k, value in records:
                    value["last_round_time"] = time.time()
                    stored += bool(self.dht.store(f"{run_id}_blocks", value, get_dht_time() + 30,
                                                  subkey=str(block).encode() + owner(k)))
                first_round.setdefault("stored", stored)
                done.set()
                self._stop.wait(10)
        self._refresh = threading.Thread(target=announce_forever, daemon=True)
        self._refresh.start()
        done.wait(300)
        return {"stored": first_round.get("stored", 0), "peer_ids": [v["peer_id"] for _, v in records],
                "stalling": list(stall_addrs)}

    def poison_upstream(self, run_id: str, block: int, holder: str, config_hash: str, n: int, shape: list[int],
                        target: int = ord("x"), seed: int = 0, batches_file: str | None = None) -> dict:
        """Announce this peer itself (its own key, its own daemon's addresses) as an online holder of block
        ``block - 1``, as any member does, then send block ``block``'s ``holder`` ``n`` poisoned micro-batches
        from it (``_send_microbatches``). Returns the answers' codes."""
        k = RSAPrivateKey()   # the Sybil's identity: its record's signer and its daemon's libp2p key
        self.dht.run_coroutine(partial(_add_signer, signer=ManyKeysSigner([k])))
        d = self._daemon_of(k)
        value = {"peer_id": peer_id_of(k), "block_index": block - 1, "state": "online", "step": 1000,
                 "samples_seen": 8000, "throughput": 100.0, "loss": 2.0, "last_round_time": time.time(),
                 "serving": True, "addresses": [str(m) for m in d.get_visible_maddrs()],
                 "software_version": "blocktrain/0.1.0", "config_hash": config_hash, "run_id": run_id}
        if not self.dht.store(f"{run_id}_blocks", value, get_dht_time() + 60, subkey=str(block - 1).encode() + owner(k)):
            raise RuntimeError("the holder record was not stored")
        return d.run_coroutine(partial(
            _send_microbatches, namespace=STALLERS["train"][1].format(run=run_id, block=block), holder=holder,
            block=block, n=n, shape=list(shape), target=target, seed=seed, batches_file=batches_file))

    def _daemon_of(self, k: RSAPrivateKey) -> DHT:
        """A DHT peer with its own libp2p daemon under identity ``k`` (its key file in this outsider's key
        directory); stopped by close()."""
        path = f"{self._key_dir}/{peer_id_of(k)[-12:]}.key"
        with open(path, "wb") as f:
            f.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=k._private_key.private_bytes(
                *_der_args())).SerializeToString())
        d = DHT(initial_peers=[self.initial_peer], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                identity_path=path, check_if_identity_free=False, client_mode=False)
        self.stallers.append(d)
        return d

    def taken(self) -> int:
        return sum(d.run_coroutine(_taken) for d in self.stallers)

    def close(self) -> None:
        self._stop.set()
        if self._refresh is not None:
            self._refresh.join(30)
        for d in [*self.stallers, self.dht]:
            try:
                d.shutdown()
            except Exception:
                pass
        shutil.rmtree(self._key_dir, ignore_errors=True)


def _der_args():
    from cryptography.hazmat.primitives import serialization
    return (serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peer", required=True)
    args = ap.parse_args()
    try:
        o = Outsider(args.initial_peer)
    except Exception as e:
        reply({"event": "failed", "error": type(e).__name__, "message": str(e)})
        return
    reply({"event": "ready", "peer_id": peer_id_of(o.key), "maddrs": o.maddrs()})
    try:
        for line in sys.stdin:
            c = json.loads(line)
            cmd = c.pop("cmd")
            if cmd == "quit":
                break
            try:
                reply({"ok": True, "result": getattr(o, cmd)(**c)})
            except Exception as e:
                reply({"ok": False, "error": type(e).__name__, "message": str(e)})
    finally:
        o.close()


if __name__ == "__main__":
    main()
