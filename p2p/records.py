"""Typed records the nodes publish in the DHT: the run manifest and per-block announcements.

These are the public (pydantic 2) models. ``to_wire()`` gives the plain dict stored in the DHT; the
strict schema every DHT node enforces on that dict lives in :mod:`blocktrain.p2p.dht_schema`.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blocktrain.p2p.errors import RecordError

__all__ = [
    "RunManifest", "BlockAnnouncement", "BlockState", "PROTOCOL_VERSION", "RUN_ID_RE",
    "validate_run_id", "RecordError", "RunAddress", "parse_run_address", "NETWORK_DATA_SPEC_RE",
    "MANIFEST_TTL", "MANIFEST_TTL_RANGE",
]

PROTOCOL_VERSION = 1
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
CONFIG_HASH_RE = r"^[0-9a-f]{8,64}$"
# What a manifest may say about the run's data: a dataset NAME (resolved by each member through its
# own known sources, never as a path) or the sha256 of private data (members bring a copy with
# --data). Never a path or glob: a stranger's manifest must not make a member read its own disk.
NETWORK_DATA_SPEC_RE = r"^(?:[a-z][a-z0-9-]{0,63}|sha256:[0-9a-f]{64})$"
MAX_ADDRESSES = 8
MANIFEST_TTL = 24 * 3600.0                  # seconds a manifest lives in the DHT after its last store
MANIFEST_TTL_RANGE = (10.0, 30 * 24 * 3600.0)
_MANIFEST_SIGNING_TAG = b"blocktrain-manifest-v1\n"   # a manifest signature signs nothing else
BlockState = Literal["joining", "online", "leaving"]


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise RecordError(
            f"run id {run_id!r} is invalid: use 1-64 characters from A-Z a-z 0-9 _ - (starting with a letter/digit)"
        )
    return run_id


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("run_id", check_fields=False)
    @classmethod
    def _check_run_id(cls, v: str) -> str:
        try:
            return validate_run_id(v)
        except RecordError as e:
            raise ValueError(str(e)) from None

    @classmethod
    def from_wire(cls, d: Any) -> "_Record":
        """Parse a dict read from the DHT; raises RecordError with pydantic's explanation."""
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise RecordError(f"invalid {cls.__name__}: {e}") from None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


class RunManifest(_Record):
    """Published by the seeding researcher; defines the run every node must match.

    ``signature`` is the seeder's own signature of every other field (:meth:`signed`), so a copy
    that another member stores under its own DHT subkey can be believed like the seeder's record:
    members keep the run's manifest in the DHT after the seeder leaves (``Discovery.keep_manifest``).
    ``ttl_s``: how long each store of it (the seeder's or a copy) lives."""

    run_id: str
    model_config_dict: dict[str, Any] = Field(alias="model_config")
    config_hash: str = Field(pattern=CONFIG_HASH_RE)
    data_spec: str = Field(pattern=NETWORK_DATA_SPEC_RE)
    target_seed: int
    protocol_version: int = PROTOCOL_VERSION
    seeder_public_key: str = Field(max_length=2048)
    created_at: float = Field(default_factory=time.time)
    ttl_s: float = Field(default=MANIFEST_TTL, ge=MANIFEST_TTL_RANGE[0], le=MANIFEST_TTL_RANGE[1])
    signature: str | None = Field(default=None, max_length=1024)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=())

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python", by_alias=True)

    def signing_bytes(self) -> bytes:
        """What the seeder signs: every field but the signature, as canonical JSON."""
        wire = {k: v for k, v in self.to_wire().items() if k != "signature"}
        return _MANIFEST_SIGNING_TAG + json.dumps(wire, sort_keys=True, separators=(",", ":"),
                                                  allow_nan=False).encode()

    def signed(self, key: Any) -> "RunManifest":
        """This manifest with its seeder's signature (``key``: the seeder's hivemind ``RSAPrivateKey``)."""
        if key.get_public_key().to_bytes().decode() != self.seeder_public_key:
            raise RecordError("only the seeder's key signs its manifest")
        return self.model_copy(update={"signature": key.sign(self.signing_bytes()).decode()})

    def signature_ok(self) -> bool:
        """True if ``signature`` is the seeder's signature of this manifest."""
        if not self.signature:
            return False
        from hivemind.utils.crypto import RSAPublicKey
        try:
            return RSAPublicKey.from_bytes(self.seeder_public_key.encode()).verify(
                self.signing_bytes(), self.signature.encode())
        except Exception:   # a malformed key or signature is no signature
            return False

    @property
    def seeder(self) -> str:
        """The seeder's peer id (its record key is its libp2p identity)."""
        from blocktrain.p2p.identity import peer_id_from_public_key
        return peer_id_from_public_key(self.seeder_public_key.encode())


class BlockAnnouncement(_Record):
    """One peer's claim to hold one block; refreshed every TTL/3 while the peer lives."""

    peer_id: str = Field(min_length=1, max_length=128)
    block_index: int = Field(ge=0, le=1023)
    state: BlockState
    step: int = Field(ge=0)
    samples_seen: int = Field(ge=0)
    throughput: float = Field(ge=0.0)  # samples/s
    loss: float | None = Field(default=None, ge=0.0, le=1e4)   # recent local training loss
    last_round_time: float | None = Field(default=None, ge=0.0)  # unix time of the last accepted averaging round
    serving: bool
    addresses: list[str] = Field(default_factory=list, max_length=MAX_ADDRESSES)
    software_version: str = Field(max_length=64)
    config_hash: str = Field(pattern=CONFIG_HASH_RE)
    run_id: str

    @field_validator("throughput", "loss", "last_round_time")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("addresses")
    @classmethod
    def _short_addresses(cls, v: list[str]) -> list[str]:
        for a in v:
            if len(a) > 256:
                raise ValueError(f"address longer than 256 characters: {a[:40]}...")
        return v

    @property
    def is_live(self) -> bool:
        return self.state in ("joining", "online")


# -- run addresses --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunAddress:
    """What a member pastes to name a run: ``RUN``, ``RUN@SEEDER_PEER_ID`` or ``RUN@/ip4/.../p2p/SEEDER``.

    With a seeder, only manifests signed by that seeder's key are believed; the multiaddr form also
    gives a peer to start from (the seeder itself)."""

    run_id: str | None = None
    seeder: str | None = None
    bootstrap: str | None = None

    def __str__(self) -> str:
        if self.run_id is None:
            return "(the initial peer's run)"
        return self.run_id if self.seeder is None else f"{self.run_id}@{self.seeder}"


_PEER_ID_RE = re.compile(r"^(Qm[1-9A-HJ-NP-Za-km-z]{44}|12D3KooW[1-9A-HJ-NP-Za-km-z]{44,48}|[1-9A-HJ-NP-Za-km-z]{40,128})$")


def parse_run_address(text: str | None) -> RunAddress:
    """Parse a run address (see :class:`RunAddress`); RecordError says what is wrong."""
    if text is None or text == "":
        return RunAddress()
    run, sep, rest = str(text).strip().partition("@")
    validate_run_id(run)
    if not sep:
        return RunAddress(run)
    if rest.startswith("/"):
        from blocktrain.p2p.addresses import AddressError, parse_multiaddr, peer_id_of
        try:
            maddr = parse_multiaddr(rest, require_peer_id=True, allow_port_zero=False)
        except AddressError as e:
            raise RecordError(f"run address {text!r}: {e}") from None
        return RunAddress(run, peer_id_of(maddr), maddr)
    if not _PEER_ID_RE.match(rest):
        raise RecordError(f"run address {text!r}: after '@' comes the seeder's peer id (Qm... or 12D3KooW...) "
                          f"or its multiaddr (/ip4/.../tcp/PORT/p2p/PEERID)")
    return RunAddress(run, rest)
