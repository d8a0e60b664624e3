"""Helpers for the reliability suite (tests/test_reliability_*.py): tiny swarms of real node
processes on 127.0.0.1, a driver for the hostile averager process, bounded waits, and a figures
log (``BT_RELIABILITY_LOG=path.jsonl``) from which RELIABILITY.md's numbers are taken."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from blocktrain.node.http.jobs import run_job
from blocktrain.node.swarm.launcher import LocalSwarm, NodeProc

from test_utils.wire_procs import JsonLinesProc

HERE = Path(__file__).resolve().parent
# small enough that several node processes start and train on a loaded 2-core machine
TINY = ["d_model=32", "n_heads=2", "layers_per_block=1", "n_blocks=2", "seq_len=32", "target_dim=16",
        "batch_size=4", "warmup_steps=0", "lr=0.002"]
# averaging only when a test asks (POST /v1/average, a job), so tests control every round
MANUAL_AVG = ["--average-every", "1000000", "--average-period", "1000000", "--average-clock", "0"]
# nodes of tests that wait for events (moves, kills, relays, signals), not for training progress, train a
# tenth of the wall time: on a 2-core machine nodes training flat out starve everything the test waits for
# (0.25 before: the rebalancing test's 5 nodes still took 120 CPU-s in 120 s)
QUIET_TRAINING = ["--train-duty", "0.1"]


def report(test: str, **figures: Any) -> None:
    """Print a test's measured figures, and append them to $BT_RELIABILITY_LOG if set."""
    line = json.dumps({"test": test, "time": round(time.time(), 1), **figures}, default=str)
    print(f"\n[reliability] {line}")
    path = os.environ.get("BT_RELIABILITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    t0 = time.monotonic()
    last_err = None
    while time.monotonic() - t0 < timeout:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # a node briefly not answering: keep waiting, bounded
            last_err = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_err})"
                                                                              if last_err else ""))


class RelSwarm(LocalSwarm):
    """LocalSwarm whose joiners can get extra environment, a faulty hop handler, and a fixed workdir."""

    def join(self, block: int | None, args: list[str] = (), *, env: dict | None = None, name: str | None = None,
             wait: bool = False, fault: str | None = None) -> NodeProc:
        """``fault``: run the node through tests/test_utils/faulty_node.py, answering every hop with
        that poison (nan_hops, inf_hops, shape_hops)."""
        name = name or f"node{len(self.nodes)}"
        a = ["join", "--initial-peers", self.seed_maddr, "--run-id", self.run_id, "--data", self.data,
             *self.extra, *args]
        if block is not None:
            a += ["--block", str(block)]
        n = NodeProc(name, a, self.base / name,
                     entry=[sys.executable, str(HERE / "faulty_node.py"), fault] if fault else None)
        n.env = env or {}
        self.nodes.append(n)
        n.start(env=n.env)
        if wait:
            n.wait_ready()
        return n


def restart(node: NodeProc, timeout: float = 120.0) -> dict:
    node.start(env=getattr(node, "env", None))
    return node.wait_ready(timeout=timeout)


def kill9(node: NodeProc) -> float:
    """SIGKILL the node's whole process group (node, DHT, averager, p2pd); returns the kill time."""
    t = time.time()
    node.signal(signal.SIGKILL)
    try:
        node.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    return t


def operator_action(node: NodeProc, path: str, timeout: float = 90.0) -> dict:
    """POST an operator action (/v1/average, /v1/eval) from 127.0.0.1 (or with the node's
    ``operator_headers`` when it has them: a node reached from another machine) and wait for its job;
    the action's result, or {'error': ...} when the job failed."""
    job = run_job(node.url, path, timeout=timeout, poll_s=0.1,   # back-to-back rounds, as when the POST held them
                  headers=getattr(node, "operator_headers", None))
    return job["result"] if job["status"] == "done" else {"error": "job failed", "detail": job["error"]}


def average_together(nodes: list[NodeProc], timeout: float = 90.0) -> dict[str, dict]:
    """An averaging round (POST /v1/average, then its job) on every node at once; {node name:
    verdict or {'error': ...}}."""
    out: dict[str, dict] = {}

    def one(n: NodeProc) -> None:
        try:
            out[n.name] = operator_action(n, "/v1/average", timeout)
        except Exception as e:
            out[n.name] = {"error": type(e).__name__, "detail": str(e)[:300]}

    ths = [threading.Thread(target=one, args=(n,)) for n in nodes]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout + 10)
    return out


def average_until_accepted(nodes: list[NodeProc], attempts: int = 4) -> dict[str, dict]:
    v: dict[str, dict] = {}
    for _ in range(attempts):
        v = average_together(nodes)
        if all(x.get("accepted") is True for x in v.values()):
            return v
        time.sleep(1.0)
    return v


def block_state(client, peer: str, block: int, attempts: int = 3) -> dict[str, torch.Tensor]:
    """A peer's block state, read to compare weights. A transport failure on a loaded machine (a
    stream cut under the download: ``truncated``, the client already asked twice; a failed dial:
    ``unreachable``) is read again; a peer that answers badly fails the test at once."""
    from blocktrain.p2p.errors import RemoteHopError
    for i in range(attempts):
        try:
            _, tensors = client.hop_client.get_block_state_sync(peer, block, timeout=30)
            return tensors
        except RemoteHopError as e:
            if e.code not in ("truncated", "unreachable") or i == attempts - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def leftover_processes(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker`` (a swarm's base directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd[:160]}")
    return found


def stop_swarm(sw: LocalSwarm, grace: float = 15.0) -> None:
    """Stop every node (SIGTERM: a graceful leave, for up to ``grace`` s in all, then SIGKILL of each
    node's process group) and make sure nothing of the swarm is left running."""
    for n in sw.nodes:
        n.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for n in sw.nodes:
        if n.proc is not None:
            try:
                n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        n.stop(timeout=0.1)   # SIGKILLs the group (DHT, averager, p2pd) whatever the node did
    deadline = time.monotonic() + 15
    left = leftover_processes(str(sw.base))
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftover_processes(str(sw.base))
    for line in left:   # last resort: kill by pid (only processes of this swarm's directory)
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    assert not left, "processes survived the swarm's teardown:\n" + "\n".join(left)


class HostileProc(JsonLinesProc):
    """Drives tests/test_utils/hostile_averager.py (a separate process in its own process group)."""

    what = "hostile averager"

    def __init__(self, initial_peers: list[str], run_id: str, log_path: Path, *, block: int = 0,
                 identities: int = 1, secret_file: Path | None = None, secret_identities: tuple = (),
                 weight: float = 1000.0, silent_identities: tuple = ()):
        args = [sys.executable, str(HERE / "hostile_averager.py"), "--initial-peers", *initial_peers,
                "--run-id", run_id, "--block", str(block), "--identities", str(identities),
                "--weight", str(weight)]
        if silent_identities:
            args += ["--silent-identities", *map(str, silent_identities)]
        if secret_file is not None:
            args += ["--secret-file", str(secret_file), "--secret-identities", *map(str, secret_identities)]
        # hivemind's own DecentralizedAverager forks a child per identity: with the DHT loop as a thread
        # of this process (BT_HIVEMIND_IN=thread, the default since the lean merge) the fork copies a lock
        # another thread holds and the child hangs on it; as children, the loops leave no thread to fork
        super().__init__("hostile", args, log_path,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", "BT_HIVEMIND_IN": "process"})

    def wait_ready(self, timeout: float = 120) -> dict:
        ev = self._ready(timeout)
        if ev.get("event") != "ready":
            raise RuntimeError(f"hostile averager failed to start: {ev}")
        return ev

    @property
    def peers(self) -> list[str]:
        return self.info["peers"]

    def result(self, timeout: float) -> dict:
        r = self._next(timeout)
        if not r.get("ok"):
            raise RuntimeError(f"hostile averager command failed: {r}")
        return r["result"]

    def stop(self, timeout: float = 0.3) -> int | None:
        """Kill the hostile process group (it, its DHT and averager processes, their p2pd)."""
        return super().stop(timeout)
