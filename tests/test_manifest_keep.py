"""A run stays joinable after its seeder leaves: members keep copies of its manifest that the seeder
signed (``Discovery.keep_manifest``, ``RunManifest.signed``), and nobody else's copy is believed.

Before: the seeder stored its manifest once, for 24 hours, and nobody refreshed it; once that store
expired (or the DHT nodes that held it left) no new member could join a run that was still training.
Real node processes on 127.0.0.1 with a 12-second manifest lifetime; a plain hivemind peer forges copies.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from blocktrain.node.swarm.launcher import LocalSwarm, NodeProc
from blocktrain.node.swarm.run import SWARM_DEFAULTS
from blocktrain.p2p.dht_schema import live_manifest_entries, owner_marker, parse_manifests
from blocktrain.p2p.errors import RecordError
from blocktrain.p2p.records import RunManifest
from hivemind.utils.timed_storage import ValueWithExpiration

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import wait_for
from test_utils.wire_procs import NodeProc as ScriptProc, stop_all

pytestmark = [pytest.mark.network]

TTL = 12.0
OUTSIDER = str(Path(__file__).parent / "test_utils" / "outsider.py")


def _manifest(key: RSAPrivateKey, **kw) -> RunManifest:
    fields = dict(run_id="r", model_config={"d_model": 32}, config_hash="0123456789abcdef", data_spec="wikitext-2",
                  target_seed=0, seeder_public_key=key.get_public_key().to_bytes().decode(), created_at=1.0)
    return RunManifest(**{**fields, **kw})


def _found(*entries) -> ValueWithExpiration:
    return ValueWithExpiration({sub: ValueWithExpiration(val, exp) for sub, val, exp in entries}, max(e[2] for e in entries))


def test_copies_are_believed_only_with_the_seeders_signature():
    seeder, member, forger = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    m = _manifest(seeder).signed(seeder)
    assert m.signature_ok()
    with pytest.raises(RecordError):
        _manifest(seeder).signed(forger)
    altered = m.model_copy(update={"data_spec": "wikitext-103"})            # the seeder's signature, other content
    forged = _manifest(seeder, target_seed=7).model_copy(update={"signature": forger.sign(b"x").decode()})
    unsigned = _manifest(seeder)
    for bad in (altered, forged, unsigned):
        assert not bad.signature_ok()
        found = _found((owner_marker(member), bad.to_wire(), 100.0))
        assert parse_manifests("r", found, None) == [], bad
    # a copy stored by a member, signed by the seeder: believed, and counted
    found = _found((owner_marker(member), m.to_wire(), 100.0), (owner_marker(forger), altered.to_wire(), 100.0))
    assert parse_manifests("r", found, m.seeder_public_key) == [m]
    assert live_manifest_entries("r", found, m.seeder_public_key, after=50.0) == 1
    assert live_manifest_entries("r", found, m.seeder_public_key, after=150.0) == 0
    # the seeder's own record (authentic by its DHT signature) wins over copies, one manifest per seeder
    own = _manifest(seeder, created_at=0.5)
    found = _found((owner_marker(member), m.to_wire(), 100.0), (owner_marker(seeder), own.to_wire(), 100.0))
    assert parse_manifests("r", found, None) == [own]
    assert live_manifest_entries("r", found, own.seeder_public_key, after=50.0) == 2


def _join_line(node: NodeProc) -> list[str]:
    lines = node.log_file.read_text().splitlines()
    return lines[lines.index("Others join with:") + 1].split()[1:]


def test_a_run_stays_joinable_after_its_seeder_left(tmp_path):
    sw = LocalSwarm(tmp_path / "net", run_id="keep", overrides=SWARM_DEFAULTS + ["n_blocks=2", "objective=paper"],
                    data=str(TEST_CORPUS))
    outsiders = []
    try:
        # no training needed: the test is about the manifest (nodes training flat out starve a loaded machine)
        seed = sw.start_seed(block=0, args=["--manifest-ttl", str(TTL), "--max-steps", "1"])
        member = sw.start_join(block=1, args=["--max-steps", "1"])
        assert seed.get("/v1/status")["run"]["manifest"]["signed"]
        wait_for(lambda: member.get("/v1/status")["run"]["manifest"].get("last") == "copied", 30,
                 "the member's copy of the manifest")
        assert seed.get("/v1/status")["run"]["manifest"].get("last") == "stored"
        line = _join_line(member)
        honest = seed.get("/v1/status")["run"]
        assert seed.stop() == 0
        t_left = time.monotonic()
        time.sleep(TTL + 3)   # the seeder's last store has expired: only members' copies remain
        # a plain hivemind peer adds a "copy" naming another config and seed, the newest, under the seeder's name
        out = ScriptProc("outsider", ["--initial-peer", member.info["maddrs"][0]], tmp_path, script=OUTSIDER)
        outsiders.append(out)
        out.wait_ready(timeout=120)
        assert out.cmd("forge_manifest_copy", run_id="keep", changes={
            "config_hash": "f" * 16, "target_seed": 99, "created_at": time.time() + 1e6})
        late = NodeProc("late", [*line, "--data", str(TEST_CORPUS), "--max-steps", "1"], tmp_path / "late")
        sw.nodes.append(late)
        late.start()
        info = late.wait_ready()
        assert time.monotonic() - t_left > TTL
        assert info["run_address"].split("@")[1] == seed.info["peer_id"]
        assert late.get("/v1/status")["run"]["config_hash"] == honest["config_hash"]   # not the forger's
    finally:
        stop_all(outsiders)
        sw.stop_all()
