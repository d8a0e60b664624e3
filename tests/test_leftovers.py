"""What a node leaves behind when it stops: hivemind's unix socket files (in a directory of its own,
removed), and no traceback of its cancelled stream handlers in its log.

Before p2p/runtime_dir.py every node left ``/tmp/hivemind-p2pclient-*.sock`` files (the replica of its RPC
loop on every clean exit; all of its sockets when SIGKILLed). Real ``bt-node seed`` processes here: a
clean stop removes the node's directory; a SIGKILLed node's directory is removed by the next node's
sweep, which leaves alone a live process's directory and another user's.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.identity import NodeIdentity
from blocktrain.p2p.runtime_dir import RUNTIME_ROOT, runtime_dir, sweep_stale_runtime_dirs

from test_utils.configs import TEST_CORPUS
from test_utils.lifecycle import Command, kill_all, wait_gone
from test_utils.reliability import QUIET_TRAINING, TINY, wait_for

pytestmark = [pytest.mark.network]

SETS = [x for kv in ["objective=paper", *TINY] for x in ("--set", kv)]


def _socket_dirs(pid: int) -> list[Path]:
    return sorted(Path(RUNTIME_ROOT).glob(f"bt-p2p-{pid}-*"))


def _start_seed(tmp_path: Path, run: str) -> tuple[Command, list[psutil.Process]]:
    ready = tmp_path / "ready.json"
    cmd = Command(["seed", "--run-id", run, *SETS, "--block", "0", "--data", str(TEST_CORPUS), "--http-port", "0",
                   "--device", "cpu", "--quiet", "--checkpoint-dir", str(tmp_path / "ckpt"), "--ready-file",
                   str(ready), *QUIET_TRAINING], tmp_path / "log")
    wait_for(lambda: ready.exists() or cmd.proc.poll() is not None, 120, "the node's ready file")
    assert ready.exists(), f"exited with {cmd.proc.returncode} before ready:\n{cmd.output()[-3000:]}"
    return cmd, cmd.tree()


def _p2pd_listen_path(procs: list[psutil.Process]) -> str:
    for p in procs:
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        if argv and os.path.basename(argv[0]) == "p2pd":
            listen = [a for a in argv if a.startswith("-listen=")]
            assert listen, argv
            return listen[0].split("=", 1)[1].removeprefix("/unix")
    raise AssertionError(f"no p2pd among {[p.pid for p in procs]}")


def test_clean_stop_leaves_no_socket_file(tmp_path):
    cmd, procs = _start_seed(tmp_path, "sock-clean")
    try:
        dirs = _socket_dirs(cmd.pid)
        assert len(dirs) == 1, dirs
        assert oct(dirs[0].stat().st_mode & 0o777) == "0o700"
        sockets = sorted(p.name for p in dirs[0].iterdir())
        # p2pd's control socket and the clients' (the DHT's, one replica per loop) are all in it
        assert Path(_p2pd_listen_path(procs)).parent == dirs[0]
        assert any(n.startswith("hivemind-p2pd-") for n in sockets), sockets
        assert sum(n.startswith("hivemind-p2pclient-") for n in sockets) >= 2, sockets
        cmd.send(signal.SIGINT, group=False)
        assert cmd.wait(30) == 0, cmd.output()[-3000:]
        assert not wait_gone(procs, 10)
        assert _socket_dirs(cmd.pid) == [], "a cleanly stopped node left its socket directory"
    finally:
        kill_all(cmd, procs)


def test_sigkilled_node_directory_is_swept(tmp_path):
    cmd, procs = _start_seed(tmp_path, "sock-kill")
    try:
        dirs = _socket_dirs(cmd.pid)
        assert len(dirs) == 1, dirs
        cmd.send(signal.SIGKILL, group=False)
        cmd.wait(10)
        assert not wait_gone(procs, 15)   # p2pd dies with the node (parent-death signal)
        assert dirs[0].exists(), "nothing could remove it: the process was SIGKILLed"
    finally:
        kill_all(cmd, procs)
    # directories the sweep must leave: a running process's (the test's parent) and another user's
    live = Path(RUNTIME_ROOT) / f"bt-p2p-{os.getppid()}-keepalive"
    foreign = Path(RUNTIME_ROOT) / f"bt-p2p-{cmd.pid}-otheruser"
    try:
        live.mkdir()
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)
        removed = sweep_stale_runtime_dirs()
        assert str(dirs[0]) in removed and not dirs[0].exists()
        assert live.exists() and foreign.exists()
        assert str(live) not in removed and str(foreign) not in removed
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(foreign, ignore_errors=True)


def test_ephemeral_identity_in_runtime_dir():
    """A throw-away identity (a client's, a plain Discovery's) keeps its key there, not in /tmp itself."""
    ident = NodeIdentity.ephemeral()
    try:
        key_dir = Path(ident.identity_path).parent
        assert key_dir.parent == Path(runtime_dir()) and key_dir.exists()
    finally:
        ident.close()
    assert not key_dir.exists()


def test_replicas_close_with_their_dht():
    """In one process: the socket of each loop's replica goes when the DHT is stopped, not at exit."""
    disc = Discovery.start()
    loop = LoopThread(name="replica-test")
    try:
        assert runtime_dir() is not None
        replica = loop.run(disc.dht.replicate_p2p(), timeout=30)

        async def handler(*_args):
            return None

        # a client listens on its socket once it serves something (the node's RPC loop serves its block)
        loop.run(replica.add_binary_stream_handler("bt-socket-test", handler), timeout=30)
        path = Path(replica._client_listen_maddr["unix"])
        assert path.parent == Path(runtime_dir()) and path.exists()
        disc.shutdown(withdraw=False)
        assert not path.exists(), "the replica's socket outlived its DHT"
    finally:
        disc.shutdown(withdraw=False)
        loop.stop()


def test_a_stopping_loop_logs_no_cancelled_handler(caplog, tmp_path):
    """A loop stopped while a connection handler waits (hivemind's stream handlers when a node leaves)
    cancels the handler quietly: Python 3.11's streams printed a CancelledError traceback per handler
    into the node's log at a clean exit (p2p/aioloop.py ``quiet_cancelled``)."""
    lt = LoopThread(name="quiet-stop-test")
    path = str(tmp_path / "s.sock")

    async def handler(reader, writer):
        await asyncio.sleep(3600)

    lt.run(asyncio.start_unix_server(handler, path), timeout=10)
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(path)
        time.sleep(0.3)   # the handler's task is waiting
        with caplog.at_level(logging.DEBUG):
            lt.stop()
    finally:
        client.close()
        lt.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
