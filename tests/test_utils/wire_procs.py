"""Helpers for the p2p tests: real node processes on 127.0.0.1 that are always cleaned up, and a rogue writer.

``NodeProc`` runs ``python tests/test_utils/wire_node.py`` in its own session (process group), so
teardown can kill the node together with its DHT process and p2pd daemons. It and the hostile
averager's driver (reliability.py) are :class:`JsonLinesProc`, which starts and stops its process
with the launcher's :class:`ManagedProcess`.

Run as a script (``python tests/test_utils/wire_procs.py rogue ...``) this file is a *hostile* DHT peer: it
signs with its own key but writes (1) under a victim's subkey, (2) schema-violating values and (3)
well-formed announcements that claim the victim's peer id. It prints one JSON line and exits.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from blocktrain.node.swarm.launcher import ManagedProcess

WIRE_NODE = str(Path(__file__).with_name("wire_node.py"))


class NodeCommandError(Exception):
    def __init__(self, error: str, message: str):
        super().__init__(f"{error}: {message}")
        self.error = error
        self.message = message


class JsonLinesProc(ManagedProcess):
    """A test process speaking JSON lines: commands on its stdin, one JSON line per answer (the
    first one ``{"event": "ready", ...}``) on its stdout, its stderr in ``log_dir/<name>.log``.
    Started in its own session by :class:`ManagedProcess`, so :meth:`kill` takes its children
    (DHT, p2pd) too."""

    what = "node"   # how errors name the process

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, *, env: dict | None = None):
        super().__init__(name, log_path)
        # one thread per library, as the launcher gives a node (several test processes share the machine;
        # and so the suite's node template can fork it: test_utils/zygote.py), unbuffered output
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        env = {**threads, **(env or os.environ), "PYTHONUNBUFFERED": "1"}
        self.start_process(list(cmd), env=env, pipe_stdio=True, append=False)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict[str, Any] = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.what} {self.name} gave no answer within {timeout}s; log: {self.tail()}") from None
        if line is None:
            raise RuntimeError(f"{self.what} {self.name} exited (rc={self.proc.poll()}); log: {self.tail()}")
        return json.loads(line)

    def _ready(self, timeout: float) -> dict[str, Any]:
        """The first line, which must be ``{"event": "ready", ...}``; kept in ``info``."""
        ev = self._next(timeout)
        if ev.get("event") == "ready":
            self.info = ev
        return ev

    def send(self, cmd: str, **kwargs: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def request_quit(self) -> None:
        try:
            if self.alive:
                self.send("quit")
        except (BrokenPipeError, OSError):
            pass

    def kill(self, grace: float = 8.0) -> None:
        """Wait up to ``grace`` s for a clean exit (after :meth:`request_quit`), then SIGTERM and
        SIGKILL of the whole process group."""
        self.wait(grace)
        self.stop(timeout=0.3)


class NodeProc(JsonLinesProc):
    """A wire test node (tests/test_utils/wire_node.py) in its own session."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, script: str = WIRE_NODE):
        super().__init__(name, [sys.executable, script, *args], log_dir / f"{name}.log")

    def wait_ready(self, timeout: float = 90) -> dict[str, Any]:
        ev = self._ready(timeout)
        if ev.get("event") != "ready":
            raise NodeCommandError(ev.get("error", "NotReady"), ev.get("message", str(ev)))
        return ev

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    @property
    def maddrs(self) -> list[str]:
        return self.info["maddrs"]

    def cmd(self, cmd: str, timeout: float = 30, **kwargs: Any) -> Any:
        self.send(cmd, **kwargs)
        reply = self._next(timeout)
        if not reply.get("ok"):
            raise NodeCommandError(reply.get("error", "?"), reply.get("message", ""))
        return reply["result"]


def stop_all(nodes: Iterable[NodeProc]) -> None:
    nodes = list(nodes)
    for n in nodes:
        n.request_quit()
    for n in nodes:
        n.kill()


def group_alive(pid: int) -> bool:
    """Whether any process of the process group ``pid`` is still alive."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


# -- rogue peer (script mode) --------------------------------------------------------------------
def rogue_main(argv: list[str]) -> None:
    import argparse

    from hivemind.dht import DHT
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.crypto import RSAPrivateKey
    from hivemind.utils.timed_storage import get_dht_time

    from blocktrain.p2p.dht_schema import blocks_key, owner_marker

    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--config-hash", required=True)
    p.add_argument("--victim-peer-id", required=True)
    p.add_argument("--victim-public-key", required=True)
    a = p.parse_args(argv)

    class ForgingSigner(RSASignatureValidator):
        """Signs every record with the rogue's key (whoever the subkey names) and accepts anything."""

        def sign_value(self, record: DHTRecord) -> bytes:
            return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", self._private_key.sign(
                self._serialize_record(record)))

        def validate(self, record: DHTRecord) -> bool:
            return True

    key = RSAPrivateKey()
    dht = DHT(initial_peers=[a.peer], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              record_validators=[ForgingSigner(key)])
    try:
        victim_marker = b"[owner:" + a.victim_public_key.encode() + b"]"
        base = dict(peer_id=a.victim_peer_id, block_index=0, state="online", step=999, samples_seen=0,
                    throughput=1.0, loss=None, last_round_time=None, serving=True, addresses=[],
                    software_version="rogue",
                    config_hash=a.config_hash, run_id=a.run_id)
        exp = get_dht_time() + 60
        k = blocks_key(a.run_id)
        dht.get(k, latest=True)   # a lookup first, so the routing table knows the honest nodes
        results = {
            "forge": dht.store(k, base, exp, subkey=b"0" + victim_marker),
            "invalid": dht.store(k, {**base, "block_index": "4", "throughput": 7}, exp, subkey=b"4" + owner_marker(key)),
        }
        # a record valid as a record (every field of an announcement, signed by the key it names)
        results["impersonate"] = dht.store(k, {**base, "block_index": 5}, exp, subkey=b"5" + owner_marker(key))
        print(json.dumps({"results": results, "rogue_owner": key.get_public_key().to_bytes().decode()[-24:]}),
              flush=True)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rogue":
        rogue_main(sys.argv[2:])
    else:
        sys.exit("usage: python tests/test_utils/wire_procs.py rogue --peer MADDR --run-id R --config-hash H "
                 "--victim-peer-id P --victim-public-key KEY")
