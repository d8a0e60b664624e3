"""A member whose clock is off by minutes (a laptop without NTP).

hivemind's DHT refuses to bootstrap with peers whose time differs by more than 3 s; the member used
to stop with hivemind's words (``ValidationError: local time must be within 3 seconds  of others(local:
1796537543.56840, peer: 1796537663.56945)``). It now says how far its clock is off, which way, and what
to do. The member's clock is moved with libfaketime (``.ci/run`` installs it); its p2p daemon (Go, which
reads the clock without libc) keeps the real time, as it would not matter to it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import SWARM_DEFAULTS
from blocktrain.p2p.discovery import clock_skew

from test_utils.configs import TEST_CORPUS


def test_clock_skew_is_read_from_hivemind_refusal():
    e = ValueError("ValidationError: local time must be within 3 seconds  of others(local: 1796537543.56840, "
                   "peer: 1796537663.56945)")
    assert clock_skew(e) == pytest.approx(-120.001, abs=1e-3)
    assert clock_skew(ValueError("failed to connect to bootstrap peers")) is None


@pytest.mark.network
def test_a_member_whose_clock_is_two_minutes_behind_is_told_so(tmp_path):
    if shutil.which("faketime") is None:
        pytest.skip("libfaketime (Debian: faketime) is not installed; .ci/run installs it")
    sw = LocalSwarm(tmp_path / "net", run_id="skew", overrides=SWARM_DEFAULTS + ["n_blocks=2", "objective=paper"],
                    data=str(TEST_CORPUS))
    try:
        sw.start_seed(block=0, args=["--max-steps", "1"])
        r = subprocess.run(["faketime", "-f", "-120s", sys.executable, "-m", "blocktrain.cli.main", "join",
                            "--initial-peers", sw.seed_maddr, "--run-id", "skew", "--data", str(TEST_CORPUS),
                            "--checkpoint-dir", str(tmp_path / "late")],
                           capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    finally:
        sw.stop_all()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    m = re.match(r"Error: this machine's clock is (\d+) s behind its initial peers'", err)
    assert m and 115 <= int(m.group(1)) <= 125, err   # 120 s, give or take the message's time in flight
    assert "NTP" in err, err
