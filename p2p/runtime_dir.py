"""This process's p2p runtime files (hivemind's unix sockets, an ephemeral identity's key) in a
directory of its own, gone when the process exits.

hivemind talks to p2pd over unix sockets it names ``/tmp/hivemind-p2pd-*.sock`` (the daemon's control
socket) and ``/tmp/hivemind-p2pclient-*.sock`` (one per client: the DHT's, and one replica per event
loop that calls the daemon). It removes a daemon's socket only when it stops a p2pd that is still
running and a client's only when that ``P2P`` object is shut down, so every node left files in /tmp:
the replica of the node's RPC loop on every clean exit (hivemind never shuts replicas down), and all
of them when the node was SIGKILLed or p2pd had already exited (measured before this module: 1,224
such files in /tmp after a day of test runs on the project's VM).

:func:`use_runtime_dir` points hivemind at a fresh directory ``/tmp/bt-p2p-PID-XXXXXXXX``
(mode 0700; ``/tmp`` like hivemind's own, as a socket path must stay under 108 bytes), which also
holds the key of an identity made for one run (``NodeIdentity.ephemeral``: a node without
``--identity``, a client), removed with everything in it when the process exits normally (``atexit``). A process that cannot run its exit
handlers (SIGKILL, a power cut) leaves its directory; the next node started by the same user removes
every such directory whose process is gone (:func:`sweep_stale_runtime_dirs`). Other programs' files
are never touched: only directories of this naming, owned by this user, whose pid is not running.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import tempfile
import threading

__all__ = ["RUNTIME_DIR_PREFIX", "RUNTIME_ROOT", "runtime_dir", "sweep_stale_runtime_dirs", "use_runtime_dir"]

logger = logging.getLogger(__name__)

RUNTIME_ROOT = "/tmp"              # hivemind's own choice; a socket path must stay under 108 bytes
RUNTIME_DIR_PREFIX = "bt-p2p-"
_DIR_NAME = re.compile(r"^bt-p2p-(\d+)-[A-Za-z0-9_]+$")

_lock = threading.Lock()
_dir: str | None = None
_owner_pid: int | None = None


def runtime_dir() -> str | None:
    """This process's runtime directory, or None before :func:`use_runtime_dir`."""
    return _dir if _owner_pid == os.getpid() else None


def use_runtime_dir() -> str:
    """Make (once per process) this process's runtime directory and point hivemind's ``P2P`` at it.

    Idempotent; a forked child that calls it gets a directory of its own (its parent's would be
    removed when the parent exits). Sweeps stale directories of dead processes first."""
    global _dir, _owner_pid
    with _lock:
        if _dir is not None and _owner_pid == os.getpid():
            return _dir
        sweep_stale_runtime_dirs()
        path = tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-", dir=RUNTIME_ROOT)
        from hivemind.p2p import P2P

        P2P._UNIX_SOCKET_PREFIX = f"/unix{path}/hivemind-"
        _dir, _owner_pid = path, os.getpid()
        atexit.register(_remove_own_dir, path, os.getpid())
        return path


def _remove_own_dir(path: str, pid: int) -> None:
    if os.getpid() == pid:   # a forked child inherits the handler, not the directory
        shutil.rmtree(path, ignore_errors=True)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: running
        return True
    return True


def sweep_stale_runtime_dirs(root: str = RUNTIME_ROOT) -> list[str]:
    """Remove this user's runtime directories whose process is no longer running; return their paths."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _DIR_NAME.match(name)
        if m is None:
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):   # lstat: a link is not a directory
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_running(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        logger.info("removed %d runtime director%s of nodes that are gone: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed
