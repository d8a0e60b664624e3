"""Node identity: stable PeerID across restarts, one key for PeerID and record signatures, exclusive lock."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from blocktrain.p2p.identity import IdentityError, IdentityInUseError, NodeIdentity, peer_id_from_public_key
from test_utils.wire_procs import NodeCommandError, NodeProc, group_alive, stop_all


def test_create_then_reload_gives_same_peer_id(tmp_path):
    with NodeIdentity.load_or_create(tmp_path) as first:
        path = Path(first.identity_path)
        assert path == tmp_path / "identity.key"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # the PeerID is the one libp2p/hivemind derive from the file
        assert first.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
        pub = first.public_key
    with NodeIdentity.load_or_create(path) as again:
        assert again.peer_id == first.peer_id and again.public_key == pub


def test_record_key_is_the_peer_key(tmp_path):
    with NodeIdentity.load_or_create(tmp_path / "node.key") as ident:
        sig = ident.record_key.sign(b"hello")
        assert ident.record_key.get_public_key().verify(b"hello", sig)
        assert peer_id_from_public_key(ident.public_key) == ident.peer_id


def test_second_holder_gets_clear_error_until_released(tmp_path):
    first = NodeIdentity.load_or_create(tmp_path)
    with pytest.raises(IdentityInUseError, match=rf"already in use by another live process \(pid {os.getpid()}\)"):
        NodeIdentity.load_or_create(tmp_path)
    first.close()
    NodeIdentity.load_or_create(tmp_path).close()


def test_bad_identity_files_are_refused(tmp_path):
    bad = tmp_path / "corrupt.key"
    bad.write_bytes(b"\x00\x01 definitely not a key")
    with pytest.raises(IdentityError, match="not a libp2p private key|unreadable RSA key"):
        NodeIdentity.load_or_create(bad)
    ed = tmp_path / "ed.key"
    ed.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=b"\x00" * 64).SerializeToString())
    with pytest.raises(IdentityError, match="holds a Ed25519 key; BlockTrain needs an RSA key"):
        NodeIdentity.load_or_create(ed)


def test_accepts_identity_written_by_hivemind(tmp_path):
    path = tmp_path / "hm.key"
    P2P.generate_identity(str(path))
    with NodeIdentity.load_or_create(path) as ident:
        assert ident.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()


def test_ephemeral_identity_is_removed_on_close():
    ident = NodeIdentity.ephemeral()
    path = Path(ident.identity_path)
    assert path.exists()
    ident.close()
    assert not path.parent.exists()


@pytest.mark.network
@pytest.mark.timeout(120)
def test_peer_id_survives_restart_and_second_live_process_is_refused(tmp_path):
    ident_dir = tmp_path / "node"
    args = ["--run-id", "ident-test", "--identity", str(ident_dir)]
    nodes: list[NodeProc] = []
    try:
        first = NodeProc("first", args, tmp_path)
        nodes.append(first)
        peer = first.wait_ready()["peer_id"]
        dup = NodeProc("duplicate", args, tmp_path)
        nodes.append(dup)
        with pytest.raises(NodeCommandError) as e:
            dup.wait_ready()
        assert e.value.error == "IdentityInUseError"
        assert str(ident_dir / "identity.key") in e.value.message and "already in use" in e.value.message
        stop_all([first, dup])
        restarted = NodeProc("restarted", args, tmp_path)
        nodes.append(restarted)
        assert restarted.wait_ready()["peer_id"] == peer
    finally:
        stop_all(nodes)
        assert not any(group_alive(n.proc.pid) for n in nodes)
    with NodeIdentity.load_or_create(ident_dir) as ident:  # the lock was released by the exits
        assert ident.peer_id == peer
