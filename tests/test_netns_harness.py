"""The network-namespace harness itself (tests/test_utils/netns.py): hosts reach each other over
their own addresses, a host behind NAT can dial out but cannot be dialled, links are rate-limited,
and everything the harness made is gone after an exception, after the harness is SIGKILLed (its
reaper cleans up) and, if the reaper dies too, at the next harness's start (the sweep)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_utils.netns import STATE_DIR, NetLab, namespaces, sh, skip_without_namespaces
from test_utils.reliability import report, wait_for

pytestmark = [pytest.mark.network]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def _namespaces_or_skip():
    skip_without_namespaces()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _serve(host, port: int) -> subprocess.Popen:
    """A TCP server inside ``host`` that sends 6 MB to whoever connects (then closes)."""
    code = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            "s.bind((sys.argv[1],int(sys.argv[2])));s.listen(8)\nwhile True:\n"
            " c,_=s.accept()\n try: c.sendall(b'x'*6_000_000)\n except OSError: pass\n c.close()\n")
    return subprocess.Popen(host.cmd(sys.executable, "-c", code, host.addr, str(port)), start_new_session=True)


def _download_mbit(src, addr: str, port: int) -> float:
    code = ("import socket,sys,time\ns=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=30)\n"
            "t=time.monotonic();n=0\nwhile True:\n d=s.recv(1<<16)\n if not d: break\n n+=len(d)\n"
            "print(n*8/1e6/(time.monotonic()-t))\n")
    return float(sh(*src.cmd(sys.executable, "-c", code, addr, str(port)), timeout=60).stdout.strip())


def test_hosts_reach_each_other_nat_host_is_not_dialable_and_links_are_limited():
    with NetLab(rate_mbit=20) as lab:
        a, b, n = lab.host("a"), lab.host("b"), lab.nat_host("n")
        servers = [_serve(a, 9000), _serve(n, 9000)]
        try:
            wait_for(lambda: lab.can_connect(b, a.addr, 9000), 30, "the server in host a")
            assert lab.can_connect(n, a.addr, 9000), "the NAT host cannot dial out"
            assert not lab.can_connect(a, n.addr, 9000), "the NAT host's LAN address is dialable from outside"
            assert not lab.can_connect(a, n.public_addr, 9000), "the NAT router forwards inbound connections"
            assert not lab.can_connect(a, "127.0.0.1", 9000), "a host reached another one over loopback"
            for ns, dev in ((a.ns, "eth0"), (lab.switch_ns, "p1")):
                q = sh("tc", "-n", ns, "qdisc", "show", "dev", dev).stdout
                assert "tbf" in q and "20Mbit" in q, q
            mbit = _download_mbit(b, a.addr, 9000)
            nat_mbit = _download_mbit(n, a.addr, 9000)
        finally:
            for s in servers:
                os.killpg(s.pid, signal.SIGKILL)
        report("netns_link", limit_mbit=20, measured_mbit=round(mbit, 2), through_nat_mbit=round(nat_mbit, 2))
        # a 20 Mbit/s link cannot carry much more than 20 Mbit/s (the token bucket's burst aside)
        assert 1.0 < mbit < 30.0, mbit
        assert 1.0 < nat_mbit < 30.0, nat_mbit
    assert not lab.leftovers()


def test_everything_is_removed_after_an_exception():
    lab = NetLab()
    with pytest.raises(RuntimeError, match="boom"):
        with lab:
            h = lab.host("x")
            lab.nat_host("y")
            p = subprocess.Popen(h.cmd("sleep", "600"), start_new_session=True)
            raise RuntimeError("boom")
    p.wait(timeout=15)   # killed with its namespace
    assert not lab.leftovers()
    assert not lab.state_file.exists()


HARNESS_SCRIPT = """
import json, subprocess, sys, time
sys.path.insert(0, {tests!r})
from test_utils.netns import NetLab
lab = NetLab().open()
h = lab.host("h"); lab.nat_host("n")
p = subprocess.Popen(h.cmd("sleep", "600"), start_new_session=True)
print(json.dumps({{"prefix": lab.prefix, "state": str(lab.state_file), "sleep": p.pid,
                  "reaper": lab.reaper.pid, "links": lab._state["root_links"]}}), flush=True)
time.sleep(600)
"""


def _start_harness():
    proc = subprocess.Popen([sys.executable, "-c", HARNESS_SCRIPT.format(tests=str(HERE))], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    info = json.loads(proc.stdout.readline())
    assert any(ns.startswith(info["prefix"]) for ns in namespaces())
    return proc, info


def _gone(info) -> bool:
    links = sh("ip", "-o", "link", "show").stdout
    return (not any(ns.startswith(info["prefix"]) for ns in namespaces()) and not Path(info["state"]).exists()
            and not _pid_alive(info["sleep"]) and not any(f" {ln}@" in links for ln in info["links"]))


def test_harness_killed_with_sigkill_is_cleaned_up_by_its_reaper():
    proc, info = _start_harness()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    wait_for(lambda: _gone(info), 60, "the reaper to remove the killed harness's namespaces")
    report("netns_reaper", cleanup_s=round(time.monotonic() - t0, 2))


def test_leftovers_of_a_dead_run_are_swept_by_the_next_one():
    proc, info = _start_harness()
    os.kill(info["reaper"], signal.SIGKILL)   # the reaper dies first, then the harness: nobody cleans up
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    time.sleep(1.0)
    assert not _gone(info) and Path(info["state"]).exists()
    with NetLab():   # a new run sweeps the dead one's namespaces, links and processes at its start
        assert _gone(info)
    assert STATE_DIR.exists()
