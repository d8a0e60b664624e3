"""A node's persistent identity: one RSA key that fixes the libp2p PeerID AND signs the node's DHT records.

The key file uses libp2p's format (a ``crypto_pb2.PrivateKey`` protobuf holding an RSA DER key), the
same file hivemind's ``P2P.create(identity_path=...)`` reads, so the PeerID stays stable across
restarts. The same key wrapped as hivemind's ``RSAPrivateKey`` feeds ``RSASignatureValidator``; a
reader can thus check that an announcement naming peer X was signed by X's own key
(:func:`peer_id_from_public_key`). While a process uses the identity it holds an exclusive
``flock`` on ``<path>.lock``; a second live process gets :class:`IdentityInUseError`.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from blocktrain.p2p.errors import IdentityError, IdentityInUseError
from blocktrain.p2p.runtime_dir import use_runtime_dir

__all__ = ["NodeIdentity", "IdentityError", "IdentityInUseError", "peer_id_from_public_key", "DEFAULT_FILENAME"]

DEFAULT_FILENAME = "identity.key"


def _rsa_key_from_der(der: bytes) -> RSAPrivateKey:
    """Wrap an existing RSA key as hivemind's RSAPrivateKey (its pickle protocol takes DER bytes)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def _peer_id_from_rsa_public(public_key: rsa.RSAPublicKey) -> str:
    """libp2p PeerID of an RSA key: sha2-256 multihash of the protobuf-wrapped DER public key."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    pb = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(pb).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def peer_id_from_public_key(openssh_public_key: bytes) -> str:
    """PeerID (base58) of the node owning an RSA public key in OpenSSH form (``ssh-rsa AAAA...``)."""
    try:
        key = serialization.load_ssh_public_key(openssh_public_key)
    except (ValueError, TypeError) as e:
        raise IdentityError(f"not an OpenSSH public key: {e}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise IdentityError(f"expected an RSA public key, got {type(key).__name__}")
    return _peer_id_from_rsa_public(key)


def _resolve_path(dir_or_path: str | os.PathLike[str]) -> Path:
    """A directory (existing, ending in '/', or a name without a suffix) holds ``identity.key``;
    anything else (``node.key``, an existing file) is the key file itself."""
    p = Path(dir_or_path).expanduser()
    if p.is_dir() or str(dir_or_path).endswith(os.sep) or (not p.exists() and not p.suffix):
        return p / DEFAULT_FILENAME
    return p


def _write_new_key(path: Path) -> None:
    """Generate an RSA-2048 key and write it atomically (mode 0600); never overwrite an existing file."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if another process created the file meanwhile
    except FileExistsError:
        pass  # someone else won the race: use their key
    finally:
        tmp.unlink(missing_ok=True)


def _read_key(path: Path) -> tuple[bytes, rsa.RSAPrivateKey]:
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from None
    try:
        pb = crypto_pb2.PrivateKey.FromString(blob)
    except Exception:
        raise IdentityError(f"identity file {path} is not a libp2p private key (corrupt or wrong file)") from None
    if pb.key_type != crypto_pb2.RSA:
        kind = crypto_pb2.KeyType.Name(pb.key_type)
        raise IdentityError(
            f"identity file {path} holds a {kind} key; BlockTrain needs an RSA key because the same key "
            f"signs DHT records. Move the file away to generate a new identity."
        )
    try:
        key = serialization.load_der_private_key(pb.data, password=None)
    except (ValueError, TypeError) as e:
        raise IdentityError(f"identity file {path} holds an unreadable RSA key: {e}") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise IdentityError(f"identity file {path} does not hold an RSA private key")
    return pb.data, key


def _acquire_lock(path: Path) -> IO[str]:
    lock_path = path.with_name(path.name + ".lock")
    f = open(lock_path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise IdentityInUseError(
            f"identity {path} is already in use by another live process (pid {holder}); "
            f"stop that node or give this one a different identity/data directory", holder
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


@dataclass
class NodeIdentity:
    """A loaded, locked identity. Call :meth:`close` (or use as a context manager) to release the lock."""

    identity_path: str
    peer_id: str
    record_key: RSAPrivateKey
    _lock_file: IO[str] | None = field(default=None, repr=False)
    _tmp_dir: str | None = field(default=None, repr=False)

    @classmethod
    def load_or_create(cls, dir_or_path: str | os.PathLike[str]) -> "NodeIdentity":
        """Load the identity at ``dir_or_path`` (a key file such as ``node.key``, or a directory, e.g.
        the node's data dir, holding ``identity.key``), creating it if absent, and lock it for this
        process's lifetime (until :meth:`close`)."""
        path = _resolve_path(dir_or_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise IdentityError(f"cannot create directory {path.parent} for the identity: {e.strerror}") from None
        lock = _acquire_lock(path)
        try:
            if not path.exists():
                _write_new_key(path)
            der, key = _read_key(path)
        except BaseException:
            lock.close()
            raise
        return cls(
            identity_path=str(path),
            peer_id=_peer_id_from_rsa_public(key.public_key()),
            record_key=_rsa_key_from_der(der),
            _lock_file=lock,
        )

    @classmethod
    def ephemeral(cls) -> "NodeIdentity":
        """A fresh identity in a private temporary directory, deleted by :meth:`close` (or with this
        process's runtime directory, p2p/runtime_dir.py, if the process dies first)."""
        tmp = tempfile.mkdtemp(prefix="bt-identity-", dir=use_runtime_dir())
        ident = cls.load_or_create(tmp)
        ident._tmp_dir = tmp
        return ident

    @property
    def public_key(self) -> bytes:
        """The record-signing public key in OpenSSH form (what RSASignatureValidator puts in subkeys)."""
        return self.record_key.get_public_key().to_bytes()

    def close(self) -> None:
        """Release the lock (the key file stays)."""
        if self._lock_file is not None and not self._lock_file.closed:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def __enter__(self) -> "NodeIdentity":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
