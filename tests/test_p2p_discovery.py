"""Discovery with three real node processes on 127.0.0.1: A and C only know B.

One network is shared by the module (starting processes is the expensive part); each test uses
its own block indices so the tests do not depend on each other's order.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_utils.wire_procs import NodeCommandError, NodeProc, group_alive, stop_all

pytestmark = [pytest.mark.network, pytest.mark.timeout(150)]

RUN = "disc-test"
HASH = "0123456789abcdef"
OTHER_HASH = "fedcba9876543210"
SHORT_TTL = 3.0  # node D announces with this TTL


def _until(fn, timeout: float = 15.0, every: float = 0.3):
    """Poll ``fn`` until it returns a truthy value (DHT writes propagate asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    logs = tmp_path_factory.mktemp("disc-logs")
    nodes: list[NodeProc] = []
    try:
        b = NodeProc("B", ["--run-id", RUN], logs)
        nodes.append(b)
        b.wait_ready()
        for name, extra in (("A", []), ("C", []), ("D", ["--ttl", str(SHORT_TTL)])):   # each stopped by finally
            nodes.append(NodeProc(name, ["--run-id", RUN, "--initial-peer", b.maddrs[0], *extra], logs))
        a, c, d = nodes[1:]
        for n in (a, c, d):
            n.wait_ready()
        a.cmd("publish_manifest", config_hash=HASH, model_config={"d_model": 64})
        yield {"A": a, "B": b, "C": c, "D": d}
    finally:
        stop_all(nodes)
        for n in nodes:
            assert not group_alive(n.proc.pid), f"processes of node {n.name} survived teardown"


def holders(node: NodeProc, **kw) -> dict[str, list[dict]]:
    return node.cmd("list_holders", **kw)


def test_record_announced_by_a_is_found_by_c_through_b(net):
    a, c = net["A"], net["C"]
    assert a.cmd("announce", block_index=0, config_hash=HASH) is True
    got = _until(lambda: holders(c).get("0"))
    assert got == [{"peer_id": a.peer_id, "step": 0, "state": "online"}]
    manifest = c.cmd("get_manifest")
    assert manifest["config_hash"] == HASH and manifest["seeder_public_key"] == a.info["public_key"]


def test_config_mismatch_and_unknown_run_are_refused(net):
    c = net["C"]
    assert c.cmd("check_manifest", config_hash=HASH) == HASH
    with pytest.raises(NodeCommandError) as e:
        c.cmd("check_manifest", config_hash=OTHER_HASH)
    assert e.value.error == "ConfigMismatchError"
    assert HASH in e.value.message and OTHER_HASH in e.value.message
    with pytest.raises(NodeCommandError) as e:
        c.cmd("check_manifest", config_hash=HASH, run_id="no-such-run")
    assert e.value.error == "RunNotFoundError" and "no-such-run" in e.value.message


def test_holder_with_other_config_hash_is_not_listed(net):
    b, c = net["B"], net["C"]
    assert b.cmd("announce", block_index=7, config_hash=OTHER_HASH) is True
    assert b.cmd("announce", block_index=8, config_hash=HASH) is True
    got = _until(lambda: holders(c).get("8"))
    assert got and got[0]["peer_id"] == b.peer_id
    assert "7" not in holders(c)  # same run, different model config: filtered out
    assert [h["peer_id"] for h in holders(c, config_hash=OTHER_HASH)["7"]] == [b.peer_id]


def test_refresher_keeps_announcement_alive_past_ttl_and_it_expires_after(net):
    c, d = net["C"], net["D"]
    d.cmd("start_announcing", block_index=20, config_hash=HASH)  # refreshes every TTL/3 = 1 s
    assert _until(lambda: holders(c).get("20"))
    time.sleep(2 * SHORT_TTL)
    assert [h["peer_id"] for h in holders(c).get("20", [])] == [d.peer_id], "refreshed record expired"
    d.cmd("stop_announcing")
    assert _until(lambda: "20" not in holders(c), timeout=3 * SHORT_TTL), "record outlived its TTL"


def test_tombstone_removes_holder(net):
    b, c = net["B"], net["C"]
    assert b.cmd("announce", block_index=11, config_hash=HASH) is True
    assert _until(lambda: holders(c).get("11"))
    assert b.cmd("withdraw", block_index=11) == 1
    assert _until(lambda: "11" not in holders(c)), "withdrawn holder is still listed"
    entries = [e for e in b.cmd("local_entries") if e["block"] == 11]
    assert entries and all(e["value"] is None for e in entries), "the tombstone is what B stores now"


def test_forged_and_schema_violating_records_are_rejected(net):
    a, b, c = net["A"], net["B"], net["C"]
    assert a.cmd("announce", block_index=0, config_hash=HASH) is True
    assert _until(lambda: holders(c).get("0"))
    rogue = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "test_utils" / "wire_procs.py"), "rogue", "--peer", b.maddrs[0],
         "--run-id", RUN, "--config-hash", HASH, "--victim-peer-id", a.peer_id,
         "--victim-public-key", a.info["public_key"]],
        capture_output=True, text=True, timeout=90, start_new_session=True,
    )
    assert rogue.returncode == 0, rogue.stderr[-2000:]
    report = json.loads(rogue.stdout.strip().splitlines()[-1])
    rogue_owner = report["rogue_owner"]
    time.sleep(1.0)  # let stores that were going to land, land

    for node in (a, b, c):
        entries = node.cmd("local_entries")
        # (1) B-style forgery: a record under A's subkey signed by another key is stored by nobody honest
        assert not [e for e in entries if e["block"] == 0 and isinstance(e["value"], dict)
                    and e["value"]["step"] == 999], f"{node.name} stored a forged record under A's key"
        # (2) a schema-violating value is refused by every honest node
        assert not [e for e in entries if e["block"] == 4], f"{node.name} stored a schema-violating value"
    # (3) a well-signed record claiming A's peer id is stored by some honest node (it is valid as a
    # record; which nodes hold it depends on DHT distances) ...
    assert report["results"]["impersonate"], report
    assert _until(lambda: [e for n in net.values() for e in n.cmd("local_entries")
                           if e["block"] == 5 and e["owner"] == rogue_owner])
    # ... a lookup from C finds it ...
    assert _until(lambda: [e for e in c.cmd("fetched_entries") if e["block"] == 5 and e["owner"] == rogue_owner])
    # ... but readers drop it: the peer id is not the signer's
    listed = holders(c)
    assert "5" not in listed and "4" not in listed
    assert listed["0"] == [{"peer_id": a.peer_id, "step": 0, "state": "online"}]


def test_async_api_in_a_foreign_loop_and_sync_api_refuses_to_block_it():
    """A lone in-process node: the a*-methods work from the caller's own event loop, the blocking ones refuse."""
    from blocktrain.p2p.discovery import Discovery
    from blocktrain.p2p.records import BlockAnnouncement, RunManifest

    disc = Discovery.start(run_ids=["loop-test"])
    try:
        manifest = RunManifest(run_id="loop-test", model_config={}, config_hash=HASH, data_spec="wikitext-2", target_seed=0,
                               seeder_public_key=disc.public_key)
        ann = BlockAnnouncement(peer_id=disc.peer_id, block_index=0, state="online", step=1, samples_seen=0,
                                throughput=1.0, serving=True, addresses=disc.visible_maddrs(),
                                software_version="t", config_hash=HASH, run_id="loop-test")

        async def inside_a_loop():
            with pytest.raises(RuntimeError, match=r"await Discovery.alist_holders"):
                disc.list_holders("loop-test")
            await disc.apublish_manifest(manifest)
            assert (await disc.acheck_manifest("loop-test", HASH)).config_hash == HASH
            assert await disc.aannounce(ann)
            held = await disc.alist_holders("loop-test")
            assert [a.peer_id for a in held[0]] == [disc.peer_id]
            assert await disc.awithdraw() == 1
            assert await disc.alist_holders("loop-test") == {}

        asyncio.run(inside_a_loop())
    finally:
        disc.shutdown()
