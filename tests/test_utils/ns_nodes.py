"""Real ``bt-node`` processes in the network namespaces of :mod:`test_utils.netns`.

A :class:`NsNode` runs ``ip netns exec <host ns> python -m blocktrain.cli.main seed|join ...``: its
p2p traffic goes over the host's bridge (or NAT LAN) address, its HTTP API listens on the host's
management address, where the test (in the root namespace) reaches it. A public host's node binds
and announces its own address (``--host/--announce-host/--port``); a member behind NAT gets no
network flag at all, as a volunteer who just runs ``bt-node join`` would.
"""
from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

from blocktrain.node.swarm.launcher import NodeProc

from test_utils.configs import TEST_CORPUS
from test_utils.netns import Host
from test_utils.reliability import MANUAL_AVG, QUIET_TRAINING

P2P_PORT = 31337
HTTP_PORT = 8000
#: every node of the namespace tests, public or behind NAT: CPU, averaging only when a test asks, training a
#: quarter of the time (the tests wait for relays, rounds and failovers, not for training progress)
NODE_ARGS = ["--device", "cpu", *MANUAL_AVG, "--checkpoint-every", "1000", *QUIET_TRAINING]
DATA = str(TEST_CORPUS)


class NsNode(NodeProc):
    def __init__(self, host: Host, name: str, args: list[str], workdir: Path):
        net = [] if host.nat else ["--host", host.addr, "--announce-host", host.addr, "--port", str(P2P_PORT)]
        # the driver reaches the API over the management link, not from the node's own machine, so
        # operator actions (/v1/average) need the node's operator token
        token = secrets.token_hex(16)
        Path(workdir).mkdir(parents=True, exist_ok=True)
        token_file = Path(workdir) / "operator-token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        super().__init__(name, [*args, *net, "--http-host", host.mgmt_addr, "--operator-token-file", str(token_file)],
                         workdir, HTTP_PORT, entry=host.cmd(sys.executable, "-m", "blocktrain.cli.main"))
        self.host = host
        self.operator_headers = {"Authorization": f"Bearer {token}"}

    @property
    def url(self) -> str:
        return f"http://{self.host.mgmt_addr}:{self.http_port}"

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    @property
    def maddr(self) -> str:
        """The multiaddr others join through (its namespace address, never loopback)."""
        return f"/ip4/{self.host.addr}/tcp/{P2P_PORT}/p2p/{self.peer_id}"

    def status(self) -> dict:
        return self.get("/v1/status")

    def generate(self, prompt: str = "The ", max_bytes: int = 8, timeout: float = 120.0) -> tuple[dict, float]:
        """POST /v1/generate; (the answer, seconds it took). Raises on an HTTP error."""
        t0 = time.monotonic()
        r = self.post("/v1/generate", {"prompt": prompt, "max_bytes": max_bytes, "mode": "one_sweep"},
                      timeout=timeout)
        dt = time.monotonic() - t0
        if r.status_code != 200:
            raise AssertionError(f"generation at {self.name} failed ({r.status_code}): {r.text[:400]}")
        return r.json(), dt


def start_seed(host: Host, workdir: Path, run_id: str, overrides: list[str]) -> NsNode:
    """Seed ``run_id`` (block 0) on ``host`` with the test corpus and NODE_ARGS; waits until ready."""
    if not any(kv.startswith("objective=") for kv in overrides):
        overrides = ["objective=paper", *overrides]   # the config's objective, as LocalSwarm (the seed command's is pipeline)
    sets = [x for kv in overrides for x in ("--set", kv)]
    n = NsNode(host, host.name, ["seed", "--run-id", run_id, "--data", DATA, "--block", "0", *sets, *NODE_ARGS],
               workdir / host.name)
    n.start()
    n.wait_ready(timeout=180)
    return n


def start_join(host: Host, workdir: Path, seed: NsNode, run_id: str, block: int | None = None) -> NsNode:
    """Join through ``seed`` (its namespace address) with the same data and NODE_ARGS; not waited for."""
    args = ["join", "--initial-peers", seed.maddr, "--run-id", run_id, "--data", DATA, *NODE_ARGS]
    if block is not None:
        args += ["--block", str(block)]
    n = NsNode(host, host.name, args, workdir / host.name)
    n.start()
    return n


def route_of(answer: dict) -> dict[int, str]:
    """block -> peer id that served it, from a /v1/generate answer."""
    return {int(h["block"]): h["peer"] for h in answer.get("route", [])}
