"""A volunteer's disk fills up while the node runs.

The checkpoint write then fails with an OSError (ENOSPC). The node must go on training and serving,
say so (log, ``/v1/status`` errors and ``self.checkpoint``, ``/metrics``, the web page) and retry at
the next checkpoint, and the checkpoint already on disk must stay whole: every file is replaced
atomically, so a refused write leaves the last good one. (Before: the train loop crashed and the
node stopped, a traceback in its log.)

The disk is a real small one: a tmpfs the test mounts on the node's checkpoint directory (we are root
in tests and CI; skipped with the reason where mounting is refused) and fills with a file once the
node's first checkpoint is on it; unmounted on every exit path.
"""
from __future__ import annotations

import os
import subprocess

import httpx
import pytest
from safetensors import safe_open

from blocktrain.node.swarm.launcher import NodeProc
from blocktrain.node.swarm.run import SWARM_DEFAULTS

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import wait_for


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs mounted at ``tmp_path/node/ckpt`` (the checkpoint directory of a NodeProc in
    ``tmp_path/node``), unmounted (lazily, so a busy one goes too) at the end."""
    mnt = tmp_path / "node" / "ckpt"
    mnt.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small disk needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "bt-test-disk", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"the kernel refused a tmpfs mount: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(directory) -> None:
    """Write a file until the disk refuses (ENOSPC): the disk is full."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass



def _seed_args(max_steps: int) -> list[str]:
    sets = [x for kv in SWARM_DEFAULTS + ["n_blocks=2", "objective=paper"] for x in ("--set", kv)]
    return ["seed", "--run-id", "diskfull", "--data", str(TEST_CORPUS), "--block", "0", *sets,
            "--checkpoint-every", "2", "--max-steps", str(max_steps)]


def _saved_step(ckpt) -> int:
    with safe_open(str(ckpt / "block00.safetensors"), "pt") as f:
        return int(f.metadata()["step"])


@pytest.mark.network
def test_a_full_disk_keeps_the_node_running_and_the_last_checkpoint_whole(tmp_path, small_disk):
    work, ckpt = tmp_path / "node", small_disk
    first = NodeProc("first", _seed_args(4), work)
    try:
        first.start()
        first.wait_ready()
        wait_for(lambda: _saved_step(ckpt) == 4, 120, "the checkpoint of step 4")
    finally:
        assert first.stop() == 0, first.tail()
    assert _saved_step(ckpt) == 4
    _fill(small_disk)

    # the same node restarted on the full disk: it resumes at step 4 and trains on to 12
    node = NodeProc("full", _seed_args(12), work)
    try:
        node.start()
        node.wait_ready()
        wait_for(lambda: node.get("/v1/status")["self"]["step"] >= 12, 120, "training on past refused checkpoints")
        st = node.get("/v1/status")
        me = st["self"]
        assert me["resumed"] is True
        c = me["checkpoint"]
        assert c["failed"] >= 4 and c["written"] == 0 and c["last"] is None, c   # steps 6, 8, 10, 12
        assert "not written" in c["error"] and "training and serving go on" in c["error"], c
        assert "No space left on device" in c["error"] and str(ckpt) in c["error"], c
        # one message per streak of failures, not one per attempt
        assert sum("not written" in e for e in st["errors"]) == 1, st["errors"]
        failed = [ln for ln in httpx.get(node.url + "/metrics", timeout=30).text.splitlines()
                  if ln.startswith("blocktrain_checkpoints_failed_total")]
        assert failed and float(failed[0].split()[-1]) >= 4, failed
        assert node.alive, node.tail()
    finally:
        code = node.stop()
    log = node.tail(200)
    assert "Traceback" not in log, log
    # its final checkpoint could not be written either: the stop says so (a non-zero exit)
    assert code != 0 and "final checkpoint failed" in log, (code, log)
    # the checkpoint on disk is the last good one, whole, and no half-written file is left beside it
    assert _saved_step(ckpt) == 4
    assert not [p.name for p in ckpt.iterdir() if ".tmp-" in p.name], sorted(p.name for p in ckpt.iterdir())
