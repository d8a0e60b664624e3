"""Separate hosts on one machine: each node in its own Linux network namespace with its own address.

:class:`NetLab` builds, for one test run, a *switch* namespace holding a bridge, and for each host a
namespace joined to that bridge by a veth pair whose two ends are rate-limited with ``tc ... tbf``
(netem is not available here, so latency stays the nodes' ``--inject-delay-ms``). Hosts get
addresses in ``10.231.S.0/24`` (S picked free per run). :meth:`NetLab.nat_host` puts a host behind
a router namespace whose nftables masquerade its outbound traffic and drop every connection opened
from outside; the LAN behind it (``10.232.S.0/24``) has no route from anywhere else, so nobody can
dial such a host.

The test driver (this process, in the root namespace) reaches each host only over a separate
point-to-point *management* link (``10.233.S.x/30``) where the nodes' HTTP API listens; p2p traffic
uses the bridge/LAN addresses only (nodes bind and announce them). Nothing else of the root
namespace is touched: no bridge, route or firewall rule outside the run's own namespaces.

Cleanup on every exit path: everything is named with a per-run prefix (``btn`` + 6 hex digits) and
listed in a state file ``/run/bt-netns/<prefix>.json`` written before anything is made, which the
harness holds an ``flock`` on for its whole life. :meth:`NetLab.close` (fixture teardown, atexit,
SIGTERM/SIGINT/SIGHUP) kills every process in the run's namespaces and deletes them; a detached
reaper process (``python netns.py --reap STATE``) blocks on that lock and cleans up if the harness
dies without closing (SIGKILL); and every new NetLab first sweeps state files whose lock is free
(their owner is dead). Only the run's own namespaces, management links and state files are removed.

Run as ``python tests/test_utils/netns.py --sweep`` to remove leftovers of dead runs by hand.

(Over 400 lines on purpose: making and removing namespaces, links, rate limits and NAT rules belong
together with the cleanup that must undo exactly them.)
"""
from __future__ import annotations

import atexit
import fcntl
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STATE_DIR = Path(os.environ.get("BT_NETNS_STATE_DIR", "/run/bt-netns"))
PREFIX_RE = re.compile(r"^btn[0-9a-f]{6}$")
NS_RE = re.compile(r"^(btn[0-9a-f]{6})-")
PROBE_RE = re.compile(r"^btprobe-([0-9]+)-")
BRIDGE_NET = "10.231.{s}.0/24"       # hosts on the bridge: .1 .. .200
LAN_NET = "10.232.{s}.0/24"          # every NAT router's LAN (isolated per router): .1 router, .2 host
MGMT_NET = "10.233.{s}.0/24"         # /30 management links: driver .4i+1, host .4i+2


class NamespacesUnavailable(RuntimeError):
    """The kernel (or the lack of privileges) refuses network namespaces: tests skip with this reason."""


def sh(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run one command (no shell); a failure raises with its stderr."""
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def namespaces() -> list[str]:
    r = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def kill_namespace(ns: str, *, delete: bool = True) -> int:
    """SIGKILL every process inside ``ns`` (repeatedly, until none is left), then delete it; returns
    how many processes were killed."""
    killed = 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pids = [p for p in ns_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    if delete:
        sh("ip", "netns", "del", ns, check=False)
    return killed


def _remove_objects(state: dict) -> None:
    for ns in state.get("namespaces", []):
        if ns in namespaces():
            kill_namespace(ns)
    for link in state.get("root_links", []):
        sh("ip", "link", "del", link, check=False)


def _clean_run(state_file: Path) -> None:
    """Remove what a dead run's state file lists, then the file (caller holds its lock)."""
    try:
        state = json.loads(state_file.read_text() or "{}")
    except (OSError, ValueError):
        state = {}
    _remove_objects(state)
    state_file.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_lock(path: Path) -> int | None:
    """Open and exclusively lock ``path`` without waiting; the fd, or None if a live process holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of every run whose harness is dead (its state file unlocked),
    and namespaces named like a run that has no state file at all. Returns the prefixes swept."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    swept = []
    with _global_lock():
        for f in sorted(STATE_DIR.glob("btn*.json")):
            fd = _try_lock(f)
            if fd is None:
                continue    # a live run
            try:
                _clean_run(f)
                swept.append(f.stem)
            finally:
                os.close(fd)
        live = {f.stem for f in STATE_DIR.glob("btn*.json")}
        for ns in namespaces():   # a run always writes its state file before making anything
            m, probe = NS_RE.match(ns), PROBE_RE.match(ns)
            if (m and m.group(1) not in live) or (probe and not _pid_alive(int(probe.group(1)))):
                kill_namespace(ns)
                swept.append(ns)
    return swept


class _global_lock:
    """Serialises sweeps and subnet choice between concurrent harnesses."""

    def __enter__(self):
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(STATE_DIR / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def skip_without_namespaces() -> None:
    """In a test: skip, with the kernel's reason, where network namespaces cannot be made."""
    import pytest
    try:
        check_namespaces_work()
    except NamespacesUnavailable as e:
        pytest.skip(str(e))


def check_namespaces_work() -> None:
    """Raise NamespacesUnavailable (the reason) if this kernel/user cannot make a network namespace."""
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespace tests need root (ip netns)")
    probe = f"btprobe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        r = sh("ip", "netns", "add", probe, check=False)
    except FileNotFoundError:
        raise NamespacesUnavailable("iproute2 (`ip`) is not installed") from None
    if r.returncode != 0:
        raise NamespacesUnavailable(f"the kernel refuses network namespaces: {r.stderr.strip()}")
    sh("ip", "netns", "del", probe, check=False)


@dataclass
class Host:
    """One simulated machine: its namespace, its p2p address (bridge or NAT LAN), its management address."""
    name: str
    ns: str
    addr: str                 # where its node binds and announces p2p
    mgmt_addr: str            # where the driver reaches its HTTP API
    nat: bool = False
    router_ns: str | None = None
    public_addr: str | None = None   # behind NAT: the router's bridge address (what others see)
    alive: bool = True

    def cmd(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *args]


class NetLab:
    """The namespaces of one test run (see the module docstring). Use as a context manager."""

    def __init__(self, *, rate_mbit: float | None = 20.0):
        self.rate_mbit = rate_mbit
        self.prefix = "btn" + secrets.token_hex(3)
        self.hosts: dict[str, Host] = {}
        self._state: dict = {"namespaces": [], "root_links": []}
        self._fd: int | None = None
        self._closed = False
        self._lock = threading.RLock()   # a signal handler may re-enter close()
        self._n_bridge = 0
        self._n_mgmt = 0
        self._n_nat = 0
        self.subnet: int | None = None
        self.reaper: subprocess.Popen | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "NetLab":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "NetLab":
        check_namespaces_work()
        sweep_stale()
        with _global_lock():
            self.subnet = self._free_subnet()
            self.state_file = STATE_DIR / f"{self.prefix}.json"
            self._fd = os.open(self.state_file, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._state["subnet"] = self.subnet
            self._state["pid"] = os.getpid()
            self._save()
        atexit.register(self.close)
        self._install_signal_handlers()
        self.reaper = subprocess.Popen([sys.executable, __file__, "--reap", str(self.state_file)],
                                       start_new_session=True, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.switch_ns = self._add_ns("sw")
        sh("ip", "-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch_ns, "link", "set", "br0", "up")
        return self

    def _free_subnet(self) -> int:
        used = set()
        for f in STATE_DIR.glob("btn*.json"):
            try:
                used.add(int(json.loads(f.read_text() or "{}").get("subnet", -1)))
            except (OSError, ValueError, TypeError):
                pass
        routes = sh("ip", "-4", "route", "show", "table", "all", check=False).stdout
        for s in range(1, 255):
            if s not in used and f"10.233.{s}." not in routes:
                return s
        raise RuntimeError("no free 10.233.S.0/24 management subnet for another network-namespace run")

    def _save(self) -> None:
        data = json.dumps(self._state).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            prev = signal.getsignal(sig)

            def handler(signum, frame, prev=prev):
                self.close()
                if callable(prev):
                    prev(signum, frame)
                elif prev == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)
            signal.signal(sig, handler)

    def close(self) -> None:
        """Kill every process in the run's namespaces and delete them and the management links (idempotent)."""
        with self._lock:
            if self._closed or self._fd is None:
                return
            self._closed = True
            try:
                _remove_objects(self._state)
            finally:
                self.state_file.unlink(missing_ok=True)
                os.close(self._fd)   # releases the lock: the reaper wakes, finds no file, exits
                self._fd = None

    def leftovers(self) -> list[str]:
        """The run's namespaces and root links that still exist (empty after close)."""
        left = [ns for ns in namespaces() if ns.startswith(self.prefix + "-")]
        links = sh("ip", "-o", "link", "show", check=False).stdout
        left += [ln for ln in self._state["root_links"] if f" {ln}@" in links or f" {ln}:" in links]
        return left

    # -- building -----------------------------------------------------------------------------
    def _add_ns(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        self._state["namespaces"].append(ns)   # recorded before it exists: a crash now still sweeps it
        self._save()
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _limit(self, ns: str, dev: str) -> None:
        if self.rate_mbit:
            sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
               "burst", "64kb", "latency", "200ms")

    def _bridge_port(self, ns: str, dev: str) -> str:
        """A veth pair from ``ns`` (named ``dev`` there) to the bridge, both ends rate-limited; the address."""
        self._n_bridge += 1
        i = self._n_bridge
        if i > 200:
            raise RuntimeError("at most 200 hosts per NetLab")
        port = f"p{i}"
        sh("ip", "-n", self.switch_ns, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns)
        sh("ip", "-n", self.switch_ns, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.switch_ns, "link", "set", port, "up")
        addr = str(ipaddress.ip_network(BRIDGE_NET.format(s=self.subnet))[i])
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        self._limit(self.switch_ns, port)   # towards the host: its download
        self._limit(ns, dev)                # from the host: its upload
        return addr

    def _mgmt_link(self, ns: str) -> str:
        """A point-to-point link from the root namespace to ``ns`` for the driver's HTTP calls only."""
        i = self._n_mgmt
        self._n_mgmt += 1
        if i >= 63:
            raise RuntimeError("at most 63 managed hosts per NetLab")
        root_dev = f"{self.prefix}m{i}"
        self._state["root_links"].append(root_dev)
        self._save()
        sh("ip", "link", "add", root_dev, "type", "veth", "peer", "name", "mgmt", "netns", ns)
        net = ipaddress.ip_network(MGMT_NET.format(s=self.subnet))
        a_root, a_ns = str(net[4 * i + 1]), str(net[4 * i + 2])
        sh("ip", "addr", "add", f"{a_root}/30", "dev", root_dev)
        sh("ip", "link", "set", root_dev, "up")
        sh("ip", "-n", ns, "addr", "add", f"{a_ns}/30", "dev", "mgmt")
        sh("ip", "-n", ns, "link", "set", "mgmt", "up")
        return a_ns

    def host(self, name: str) -> Host:
        """A host on the bridge: dialable by every other host at its address."""
        ns = self._add_ns(name)
        addr = self._bridge_port(ns, "eth0")
        h = Host(name, ns, addr, self._mgmt_link(ns))
        self.hosts[name] = h
        return h

    def nat_host(self, name: str) -> Host:
        """A host behind a masquerading router: it can open connections to the bridge's hosts (they
        see the router's address), and nobody can open one to it."""
        self._n_nat += 1
        router = self._add_ns(f"{name}-rt")
        wan = self._bridge_port(router, "wan")
        ns = self._add_ns(name)
        lan = ipaddress.ip_network(LAN_NET.format(s=self.subnet))
        r_lan, h_lan = str(lan[1]), str(lan[2])
        sh("ip", "-n", router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", router, "addr", "add", f"{r_lan}/24", "dev", "lan")
        sh("ip", "-n", router, "link", "set", "lan", "up")
        sh("ip", "-n", ns, "addr", "add", f"{h_lan}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", r_lan)
        sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = (
            "table ip btnat {\n"
            "  chain postrouting {\n"
            "    type nat hook postrouting priority srcnat; policy accept;\n"
            '    oifname "wan" masquerade\n'
            "  }\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter; policy drop;\n"
            "    ct state established,related accept\n"
            '    iifname "lan" oifname "wan" accept\n'
            "  }\n"
            "}\n")
        r = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, text=True,
                           capture_output=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"nftables in the NAT router failed (is `nft` installed? .ci/run installs "
                               f"nftables): {r.stderr.strip()}")
        h = Host(name, ns, h_lan, self._mgmt_link(ns), nat=True, router_ns=router, public_addr=wan)
        self.hosts[name] = h
        return h

    # -- using --------------------------------------------------------------------------------
    def kill_host(self, host: Host) -> int:
        """Pull the plug: SIGKILL every process in the host's namespace, then delete the namespace
        (its links go with it). Returns how many processes were killed."""
        killed = kill_namespace(host.ns)
        host.alive = False
        return killed

    def can_connect(self, src: Host, addr: str, port: int, timeout: float = 3.0) -> bool:
        """Whether a TCP connection from inside ``src`` to ``addr:port`` is accepted."""
        code = ("import socket,sys\n"
                "s=socket.socket(); s.settimeout(float(sys.argv[3]))\n"
                "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
                "except OSError as e:\n print('closed', e)\n")
        r = sh(*src.cmd(sys.executable, "-c", code, addr, str(port), str(timeout)), timeout=timeout + 20)
        return r.stdout.startswith("open")


def _reap(state_path: str) -> None:
    """Detached reaper: wait until the harness releases its lock (it closed, or died), then remove
    whatever the state file still lists."""
    path = Path(state_path)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    fcntl.flock(fd, fcntl.LOCK_EX)   # blocks while the harness lives
    try:
        if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
            return   # closed cleanly
        with _global_lock():
            _clean_run(path)
    finally:
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reap":
        _reap(sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "--sweep":
        print("swept:", sweep_stale())
    else:
        sys.exit("usage: netns.py --reap STATE_FILE | --sweep")
