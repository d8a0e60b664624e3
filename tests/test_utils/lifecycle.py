"""Drivers for the lifecycle tests (tests/test_lifecycle.py): a ``bt-node`` command started the way
a user starts it (in its own session, or on a pseudo-terminal where Ctrl-C is a real ``\\x03``),
every process it grew (psutil, by parent pid, whatever session it moved to), and bounded waits
for them to be gone.

Plain ``subprocess`` on purpose: the launcher's own helpers (parent-death signal, group kill) are
part of what these tests check, so the test process is an ordinary parent.
"""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import psutil

BT_NODE = [sys.executable, "-m", "blocktrain.cli.main"]


class Command:
    """One ``bt-node`` process in its own session; with ``tty`` its stdin/stdout/stderr are a
    pseudo-terminal whose controlling process group it leads (as in a terminal window)."""

    def __init__(self, args: list[str], log: Path, *, tty: bool = False, env: dict | None = None,
                 prog: list[str] | None = None):
        self.log = Path(log)
        self.tty = tty
        self._buf = bytearray()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               **(env or {})}
        if tty:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
            self.proc = subprocess.Popen([*(prog or BT_NODE), *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                                         start_new_session=True, preexec_fn=_take_terminal)
            os.close(slave)
            self._master = master
            threading.Thread(target=self._drain, daemon=True).start()
        else:
            with open(self.log, "wb") as f:
                self.proc = subprocess.Popen([*(prog or BT_NODE), *args], stdin=subprocess.DEVNULL, stdout=f,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pid = self.proc.pid

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 4096)
            except OSError:   # EIO: every process holding the terminal has gone
                break
            if not chunk:
                break
            self._buf.extend(chunk)
            with open(self.log, "ab") as f:
                f.write(chunk)

    def output(self) -> str:
        if self.tty:
            return self._buf.decode(errors="replace")
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ctrl_c(self) -> None:
        """Type Ctrl-C on its terminal: the kernel sends SIGINT to the terminal's foreground group."""
        os.write(self._master, b"\x03")

    def send(self, sig: int, *, group: bool) -> None:
        if group:
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_output(self, text: str, timeout: float) -> None:
        t0 = time.monotonic()
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode} before printing {text!r}:\n"
                                     f"{self.output()[-3000:]}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"no {text!r} after {timeout:.0f}s:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def tree(self) -> list[psutil.Process]:
        """This process and every descendant now running (children moved to other sessions too)."""
        root = psutil.Process(self.pid)
        return [root, *root.children(recursive=True)]


def _take_terminal() -> None:   # in the child, after setsid: stdin (the pty) becomes its controlling tty
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` s for every process to be gone; those still running."""
    t0 = time.monotonic()
    while (left := running(procs)) and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    return left


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def kill_all(cmd: Command, procs: list[psutil.Process]) -> None:
    """Last resort of a test's cleanup: SIGKILL everything it started."""
    kill_all_procs([*procs, *_safe_tree(cmd)])
    cmd.wait(5)


def kill_all_procs(procs: list[psutil.Process]) -> None:
    for p in running(procs):
        try:
            p.kill()
        except psutil.Error:
            pass


def _safe_tree(cmd: Command) -> list[psutil.Process]:
    try:
        return cmd.tree()
    except psutil.Error:
        return []

