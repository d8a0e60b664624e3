"""A controllable wire-layer node for the p2p tests and manual debugging (tests only).

    python tests/test_utils/wire_node.py [--identity PATH] [--initial-peer MADDR ...] --run-id R [--serve-rpc ...]

Prints one JSON line ``{"event": "ready", "peer_id", "maddrs", "public_key"}`` then reads JSON
commands on stdin, one per line (``{"cmd": "announce", ...}``) and answers each with one JSON line
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "<ExceptionClass>", "message": "..."}``.
Logs go to stderr. Start it with ``start_new_session=True`` and kill its process group on teardown.

The RPC hop handler is deterministic: ``new_state = state * 0.5 + sigma`` (sigma = first noise level
of each row), logits = one-hot(context) * 1.0. If the first noise level is >= 1000 it first sleeps
``sigma - 1000`` seconds (max 10), to exercise client timeouts. The state provider returns
``{"weight": arange(n), "bias": ones(3)}`` with ``n = --state-floats``; after ``{"cmd": "state_pause",
"seconds": s}`` each state tensor leaves ``s`` seconds after the previous message (a slow stream
whose metadata has already arrived, for tests that cut the connection under it).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from functools import partial
from typing import Any

import torch
from hivemind.dht import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from blocktrain.p2p.aioloop import LoopThread, in_event_loop
from blocktrain.p2p.dht_schema import blocks_key, parse_block_subkey
from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.hops import HopLimits, HopRequest, HopResponse
from blocktrain.p2p.identity import NodeIdentity
from blocktrain.p2p.records import BlockAnnouncement, RunManifest
from blocktrain.p2p import rpc_server
from blocktrain.p2p.rpc_server import BlockRPCServer

STATE_PAUSE = {"seconds": 0.0}


def _paced_encode(t: torch.Tensor, _encode=rpc_server.encode_tensor):
    """The server's tensor encoder, ``state_pause`` seconds late in its worker threads (state tensors;
    hop answers are encoded on the event loop and never wait)."""
    if STATE_PAUSE["seconds"] > 0 and not in_event_loop():
        time.sleep(STATE_PAUSE["seconds"])
    return _encode(t)


def hop_handler(req: HopRequest, vocab: int = 256) -> HopResponse:
    sigma = req.sigmas.reshape(-1, 2)[:, 0].to(torch.float32)
    if float(sigma.max()) >= 1000:
        time.sleep(min(10.0, float(sigma.max()) - 1000))
    n = req.state.shape[0]
    out = req.state.float() * 0.5 + sigma.expand(n).reshape(n, 1, 1)
    logits = torch.nn.functional.one_hot(req.context.long(), vocab).float() if req.want_logits else None
    return HopResponse(req.request_id, out.to(req.state.dtype), logits)


async def _local_entries(_dht: DHT, node: DHTNode, key: str) -> list[dict[str, Any]]:
    """What this DHT node itself stores under ``key`` (to show which records it accepted)."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None or not hasattr(found.value, "items"):
        return []
    out = []
    for subkey, (value_bytes, _exp) in found.value.items():
        parsed = parse_block_subkey(subkey)
        value = MSGPackSerializer.loads(RSASignatureValidator._SIGNATURE_RE.sub(b"", value_bytes))
        out.append({
            "block": parsed[0] if parsed else None,
            "owner": parsed[1].decode()[-24:] if parsed else None,
            "value": value if isinstance(value, dict) or value is None else repr(value),
        })
    return out


class ControlledNode:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.identity = NodeIdentity.load_or_create(args.identity) if args.identity else None
        self.disc = Discovery.start(
            identity=self.identity, initial_peers=args.initial_peer, host_maddrs=[args.host_maddr],
            run_ids=[args.run_id], ttl=args.ttl,
        )
        self.loop: LoopThread | None = None
        self.server: BlockRPCServer | None = None
        if args.serve_rpc:
            self.loop = LoopThread()
            p2p = self.loop.run(self.disc.dht.replicate_p2p())
            limits = HopLimits(
                allowed_blocks=frozenset(args.blocks), max_batch=args.max_batch, max_seq=args.max_seq,
                state_dim=args.dim, vocab_size=args.vocab, max_request_bytes=args.max_request_bytes,
            )
            self.server = BlockRPCServer(
                p2p, args.run_id, limits,
                lambda req: hop_handler(req, args.vocab),
                lambda b: ({"block": b, "step": 7}, {"weight": torch.arange(args.state_floats, dtype=torch.float32),
                                                      "bias": torch.ones(3)}),
            )
            for b in args.blocks:
                self.loop.run(self.server.add_block(b))
            rpc_server.encode_tensor = _paced_encode

    def ann(self, c: dict[str, Any]) -> BlockAnnouncement:
        return BlockAnnouncement(
            peer_id=c.get("peer_id", self.disc.peer_id), block_index=c["block_index"], state=c.get("state", "online"),
            step=c.get("step", 0), samples_seen=c.get("samples_seen", 0), throughput=c.get("throughput", 1.0),
            serving=c.get("serving", True), addresses=self.disc.visible_maddrs(),
            software_version="test", config_hash=c["config_hash"], run_id=c.get("run_id", self.args.run_id),
        )

    def handle(self, c: dict[str, Any]) -> Any:
        run = c.get("run_id", self.args.run_id)
        cmd = c["cmd"]
        if cmd == "publish_manifest":
            self.disc.publish_manifest(RunManifest(
                run_id=run, model_config=c.get("model_config", {}), config_hash=c["config_hash"],
                data_spec=c.get("data_spec", "wikitext-2"), target_seed=c.get("target_seed", 0),
                seeder_public_key=self.disc.public_key,
            ))
            return None
        if cmd == "get_manifest":
            m = self.disc.get_manifest(run)
            return None if m is None else m.to_wire()
        if cmd == "check_manifest":
            return self.disc.check_manifest(run, c["config_hash"]).config_hash
        if cmd == "announce":
            return self.disc.announce(self.ann(c))
        if cmd == "start_announcing":
            ann = self.ann(c)
            self.disc.start_announcing(lambda: ann, interval=c.get("interval"))
            return None
        if cmd == "stop_announcing":  # stop refreshing but leave no tombstone: the record must expire by itself
            self.disc.stop_announcing(withdraw=False)
            return None
        if cmd == "withdraw":  # also stops the refresher
            return self.disc.withdraw(run, c.get("block_index"))
        if cmd == "list_holders":
            h = self.disc.list_holders(run, c.get("config_hash"))
            return {str(b): [{"peer_id": a.peer_id, "step": a.step, "state": a.state} for a in anns]
                    for b, anns in h.items()}
        if cmd == "local_entries":
            return self.disc.dht.run_coroutine(partial(_local_entries, key=blocks_key(run)))
        if cmd == "fetched_entries":  # what a DHT lookup returns before readers interpret it
            found = self.disc.dht.get(blocks_key(run), latest=True)
            entries = found.value if found is not None and isinstance(found.value, dict) else {}
            return [{"block": p[0] if (p := parse_block_subkey(sk)) else None,
                     "owner": p[1].decode()[-24:] if p else None} for sk in entries]
        if cmd == "state_pause":
            STATE_PAUSE["seconds"] = min(10.0, max(0.0, float(c["seconds"])))
            return None
        if cmd == "traffic":
            return vars(self.server.traffic.snapshot()) if self.server else None
        raise ValueError(f"unknown command {cmd!r}")

    def close(self) -> None:
        if self.loop is not None and self.server is not None:
            try:
                self.loop.run(self.server.close(), timeout=5)
            except Exception:
                pass
            self.loop.stop()
        self.disc.shutdown(withdraw=False)
        if self.identity is not None:
            self.identity.close()


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--identity", default=None)
    p.add_argument("--initial-peer", action="append", default=[])
    p.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0")
    p.add_argument("--run-id", required=True)
    p.add_argument("--ttl", type=float, default=30.0)
    p.add_argument("--serve-rpc", action="store_true")
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-request-bytes", type=int, default=64 << 20)
    p.add_argument("--state-floats", type=int, default=1000)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = parse_args(argv)
    try:
        node = ControlledNode(args)
    except Exception as e:
        _reply({"event": "failed", "error": type(e).__name__, "message": str(e)})
        sys.exit(2)
    _reply({"event": "ready", "peer_id": node.disc.peer_id, "maddrs": node.disc.visible_maddrs(),
            "public_key": node.disc.public_key})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                c = json.loads(line)
                if c.get("cmd") == "quit":
                    _reply({"ok": True, "result": None})
                    break
                _reply({"ok": True, "result": node.handle(c)})
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                _reply({"ok": False, "error": type(e).__name__, "message": str(e)})
    finally:
        node.close()


if __name__ == "__main__":
    main()
