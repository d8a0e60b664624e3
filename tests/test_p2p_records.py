"""Records and the validators every DHT node runs, exercised on signed DHTRecords without a network."""
from __future__ import annotations

import dataclasses
import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from blocktrain.p2p.dht_schema import (
    block_subkey, blocks_key, make_validators, manifest_key, owner_marker, parse_block_subkey,
)
from blocktrain.p2p.dht_schema import parse_holders, parse_manifests
from blocktrain.p2p.identity import NodeIdentity
from blocktrain.p2p.records import BlockAnnouncement, RecordError, RunManifest
from hivemind.utils.timed_storage import ValueWithExpiration

RUN = "rec-test"
HASH = "0123456789abcdef"
ser = DHTProtocol.serializer


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    a = NodeIdentity.load_or_create(tmp_path_factory.mktemp("a"))
    b = NodeIdentity.load_or_create(tmp_path_factory.mktemp("b"))
    yield a, b
    a.close()
    b.close()


def ann(peer_id: str, block: int = 1, **kw) -> BlockAnnouncement:
    base = dict(peer_id=peer_id, block_index=block, state="online", step=3, samples_seen=10, throughput=2.5,
                serving=True, addresses=[], software_version="0.1", config_hash=HASH, run_id=RUN)
    return BlockAnnouncement(**{**base, **kw})


def signed(key: str, subkey: bytes, value, signer: RSAPrivateKey) -> DHTRecord:
    """What ``signer``'s DHT node would store: the value signed by its validators."""
    v = CompositeValidator(make_validators(signer, [RUN]))
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), ser.dumps(subkey), ser.dumps(value), time.time() + 30)
    return dataclasses.replace(rec, value=v.sign_value(rec))


def honest(key: RSAPrivateKey) -> CompositeValidator:
    return CompositeValidator(make_validators(key, [RUN]))


def test_models_validate_and_round_trip(keys):
    a, _ = keys
    x = ann(a.peer_id, throughput=3)  # an int is accepted and stored as float, as the DHT schema demands
    assert x.to_wire()["throughput"] == 3.0 and isinstance(x.to_wire()["throughput"], float)
    assert BlockAnnouncement.from_wire(x.to_wire()) == x
    for bad in ({"throughput": -1.0}, {"state": "asleep"}, {"run_id": "bad run!"}, {"config_hash": "XYZ"},
                {"addresses": ["/ip4/1.2.3.4/tcp/1"] * 9}, {"throughput": float("inf")}):
        with pytest.raises(RecordError):
            BlockAnnouncement.from_wire({**x.to_wire(), **bad})
    m = RunManifest(run_id=RUN, model_config={"d_model": 64}, config_hash=HASH, data_spec="wikitext-2",
                    target_seed=1, seeder_public_key=a.public_key.decode())
    assert m.to_wire()["model_config"] == {"d_model": 64}
    assert RunManifest.from_wire(m.to_wire()) == m
    assert m.seeder == a.peer_id            # the seeder's record key is its libp2p identity
    # a manifest may name a dataset or the sha256 of private data, never a path or a glob
    ok = RunManifest.from_wire({**m.to_wire(), "data_spec": "sha256:" + "ab" * 32})
    assert ok.data_spec.startswith("sha256:")
    for path in ("/home/member/private", "data/*.txt", "../secrets", "~/notes", "C:\\x", "./wikitext-2", ""):
        with pytest.raises(RecordError):
            RunManifest.from_wire({**m.to_wire(), "data_spec": path})


def test_run_addresses_parse_and_refuse_what_is_not_one():
    from blocktrain.p2p.records import parse_run_address
    pid = "QmRFu5xxEcFVMYRTUhdgsTEQYvek64166Dpvp1dHd8SpGk"
    assert parse_run_address("demo").run_id == "demo" and parse_run_address("demo").seeder is None
    a = parse_run_address(f"demo@{pid}")
    assert (a.run_id, a.seeder, a.bootstrap) == ("demo", pid, None) and str(a) == f"demo@{pid}"
    b = parse_run_address(f"demo@/ip4/10.0.0.5/tcp/31337/p2p/{pid}")
    assert (b.run_id, b.seeder, b.bootstrap) == ("demo", pid, f"/ip4/10.0.0.5/tcp/31337/p2p/{pid}")
    assert parse_run_address(None).run_id is None
    for bad in ("bad run@" + pid, "demo@notapeer", "demo@/ip4/1.2.3.4/tcp/5", "demo@", "@" + pid):
        with pytest.raises(RecordError):
            parse_run_address(bad)


def test_owner_signed_announcement_and_tombstone_are_accepted(keys):
    a, b = keys
    rec = signed(blocks_key(RUN), block_subkey(1, a.record_key), ann(a.peer_id).to_wire(), a.record_key)
    assert honest(b.record_key).validate(rec)
    tomb = signed(blocks_key(RUN), block_subkey(1, a.record_key), None, a.record_key)
    assert honest(b.record_key).validate(tomb)


def test_forgery_under_someone_elses_subkey_is_rejected(keys):
    a, b = keys
    # B's node cannot sign for A's subkey: the record goes out unsigned, and A, B, anyone reject it
    forged = signed(blocks_key(RUN), block_subkey(1, a.record_key), ann(a.peer_id, step=999).to_wire(), b.record_key)
    assert not honest(a.record_key).validate(forged)
    assert not honest(b.record_key).validate(forged)
    # B re-using A's valid signature on a modified value fails too
    good = signed(blocks_key(RUN), block_subkey(1, a.record_key), ann(a.peer_id).to_wire(), a.record_key)
    tampered = dataclasses.replace(good, value=good.value.replace(ser.dumps(3), ser.dumps(4), 1))
    assert tampered.value != good.value and not honest(b.record_key).validate(tampered)


@pytest.mark.parametrize("change", [
    {"block_index": "1"}, {"throughput": 7}, {"step": 1.0}, {"serving": 1}, {"state": "asleep"}, {"extra": 1},
    {"addresses": "not-a-list"}, {"config_hash": "nothex"},
])
def test_schema_violating_values_are_rejected(keys, change):
    a, b = keys
    value = {**ann(b.peer_id).to_wire(), **change}
    rec = signed(blocks_key(RUN), block_subkey(1, b.record_key), value, b.record_key)
    assert not honest(a.record_key).validate(rec)


def test_unprotected_subkey_and_foreign_keys(keys):
    a, b = keys
    # a subkey without an owner marker is refused under our keys (anyone could overwrite it) ...
    rec = signed(blocks_key(RUN), b"1", ann(b.peer_id).to_wire(), b.record_key)
    assert not honest(a.record_key).validate(rec)
    # ... while keys of other applications (hivemind's averager) pass: allow_extra_keys
    other = signed("some_averager_key", b"x", {"anything": [1, 2]}, b.record_key)
    assert honest(a.record_key).validate(other)


def test_reader_drops_tombstones_impostors_and_other_configs(keys):
    a, b = keys
    sk_a, sk_b = block_subkey(1, a.record_key), block_subkey(2, b.record_key)
    exp = time.time() + 30

    def found(entries):
        return ValueWithExpiration({k: ValueWithExpiration(v, exp) for k, v in entries.items()}, exp)

    assert parse_block_subkey(sk_a) == (1, a.public_key)
    got = parse_holders(RUN, found({sk_a: ann(a.peer_id).to_wire(), sk_b: ann(b.peer_id, block=2).to_wire()}), HASH)
    assert {blk: [x.peer_id for x in v] for blk, v in got.items()} == {1: [a.peer_id], 2: [b.peer_id]}
    cases = {
        "tombstone": {sk_a: None},
        "impostor": {sk_b: ann(a.peer_id, block=2).to_wire()},  # B's key, A's peer id
        "block mismatch": {sk_a: ann(a.peer_id, block=3).to_wire()},
        "other config": {sk_a: ann(a.peer_id, config_hash="ffffffffffffffff").to_wire()},
        "leaving": {sk_a: ann(a.peer_id, state="leaving").to_wire()},
        "garbage": {sk_a: {"peer_id": 5}},
    }
    for name, entries in cases.items():
        assert parse_holders(RUN, found(entries), HASH) == {}, name


def test_manifest_must_be_signed_by_its_seeder(keys):
    a, b = keys
    m = RunManifest(run_id=RUN, model_config={}, config_hash=HASH, data_spec="wikitext-2", target_seed=0,
                    seeder_public_key=a.public_key.decode())
    rec = signed(manifest_key(RUN), owner_marker(a.record_key), m.to_wire(), a.record_key)
    assert honest(b.record_key).validate(rec)
    exp = time.time() + 30
    ok = ValueWithExpiration({owner_marker(a.record_key): ValueWithExpiration(m.to_wire(), exp)}, exp)
    assert parse_manifests(RUN, ok, None) == [m]
    # B publishing a manifest that names A as seeder under B's own subkey: readers ignore it
    fake = ValueWithExpiration({owner_marker(b.record_key): ValueWithExpiration(m.to_wire(), exp)}, exp)
    assert parse_manifests(RUN, fake, None) == []
    assert parse_manifests(RUN, ok, seeder_public_key=b.public_key.decode()) == []
