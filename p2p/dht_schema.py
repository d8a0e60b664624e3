"""DHT keys and the strict schemas every node enforces on them (hivemind ``SchemaValidator``).

Per run ``R`` there are two dictionary-valued DHT keys:

* ``R_manifest``: subkey = the seeder's owner marker ``[owner:<ssh-rsa ...>]``, value = RunManifest dict.
* ``R_blocks``:   subkey = ``b"<block index>" + owner marker``, value = BlockAnnouncement dict, or
  ``None`` (a tombstone left by a peer that withdrew).

Because every subkey carries its owner's public key, ``RSASignatureValidator`` makes every node
reject a record not signed by that key, so nobody can overwrite or forge another peer's entry.
``SchemaValidator`` (with ``allow_extra_keys=True``: hivemind's averager shares the DHT) drops
values that do not match the schema below exactly (strict types, no conversions).

hivemind's SchemaValidator needs pydantic v1 models, hence ``pydantic.v1`` here.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, Literal, Optional

import pydantic.v1 as pv1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration

from blocktrain.p2p.errors import IdentityError, RecordError
from blocktrain.p2p.identity import peer_id_from_public_key
from blocktrain.p2p.records import (
    MANIFEST_TTL, MANIFEST_TTL_RANGE, NETWORK_DATA_SPEC_RE, BlockAnnouncement, RunManifest, validate_run_id,
)

logger = logging.getLogger(__name__)

__all__ = [
    "manifest_key", "blocks_key", "block_subkey", "owner_marker", "parse_block_subkey",
    "make_validators", "run_schema_validator", "parse_manifests", "live_manifest_entries", "parse_holders",
]

_STR = pv1.constr(strict=True, max_length=256)
_HASH = pv1.constr(strict=True, regex=r"^[0-9a-f]{8,64}$")
_RUN = pv1.constr(strict=True, regex=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_NONNEG_INT = pv1.conint(strict=True, ge=0)
_NONNEG_FLOAT = pv1.confloat(strict=True, ge=0.0, allow_inf_nan=False)


class AnnouncementSchema(pv1.BaseModel):
    peer_id: pv1.constr(strict=True, min_length=1, max_length=128)
    block_index: pv1.conint(strict=True, ge=0, le=1023)
    state: Literal["joining", "online", "leaving"]
    step: _NONNEG_INT
    samples_seen: _NONNEG_INT
    throughput: _NONNEG_FLOAT
    loss: Optional[pv1.confloat(strict=True, ge=0.0, le=1e4, allow_inf_nan=False)] = None
    last_round_time: Optional[_NONNEG_FLOAT] = None
    serving: pv1.StrictBool
    addresses: pv1.conlist(_STR, max_items=8)
    software_version: pv1.constr(strict=True, max_length=64)
    config_hash: _HASH
    run_id: _RUN

    class Config:
        extra = pv1.Extra.forbid


class ManifestSchema(pv1.BaseModel):
    run_id: _RUN
    model_config_: Dict[pv1.StrictStr, Any] = pv1.Field(alias="model_config")
    config_hash: _HASH
    data_spec: pv1.constr(strict=True, regex=NETWORK_DATA_SPEC_RE)
    target_seed: pv1.StrictInt
    protocol_version: pv1.StrictInt
    seeder_public_key: pv1.constr(strict=True, max_length=2048)
    created_at: pv1.confloat(strict=True, allow_inf_nan=False)
    ttl_s: pv1.confloat(strict=True, ge=MANIFEST_TTL_RANGE[0], le=MANIFEST_TTL_RANGE[1]) = MANIFEST_TTL
    signature: Optional[pv1.constr(strict=True, max_length=1024)] = None

    class Config:
        extra = pv1.Extra.forbid


class RunSchema(pv1.BaseModel):
    """Field names become DHT keys ``<run_id>_<field>`` via SchemaValidator's ``prefix``."""

    manifest: Dict[BytesWithPublicKey, ManifestSchema]
    blocks: Dict[BytesWithPublicKey, Optional[AnnouncementSchema]]


def manifest_key(run_id: str) -> str:
    return f"{validate_run_id(run_id)}_manifest"


def blocks_key(run_id: str) -> str:
    return f"{validate_run_id(run_id)}_blocks"


def owner_marker(key: RSAPrivateKey) -> bytes:
    """``[owner:<ssh-rsa ...>]``: the subkey marker that makes a record owned by ``key``."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def block_subkey(block_index: int, key: RSAPrivateKey) -> bytes:
    return str(int(block_index)).encode() + owner_marker(key)


_SUBKEY_RE = re.compile(rb"^(\d{1,4})\[owner:(.+)\]$", re.DOTALL)
_MARKER_RE = re.compile(rb"^\[owner:(.+)\]$", re.DOTALL)


def parse_block_subkey(subkey: Any) -> tuple[int, bytes] | None:
    """``(block index, owner's OpenSSH public key)`` of a blocks subkey, or None if malformed."""
    if not isinstance(subkey, bytes):
        return None
    m = _SUBKEY_RE.match(subkey)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_owner_marker(subkey: Any) -> bytes | None:
    if not isinstance(subkey, bytes):
        return None
    m = _MARKER_RE.match(subkey)
    return m.group(1) if m else None


def run_schema_validator(run_id: str) -> SchemaValidator:
    return SchemaValidator(RunSchema, allow_extra_keys=True, prefix=validate_run_id(run_id))


def make_validators(record_key: RSAPrivateKey, run_ids: list[str] | tuple[str, ...] = ()) -> list[RecordValidatorBase]:
    """The validators every BlockTrain DHT node runs: signatures always, schemas for the runs it follows."""
    return [RSASignatureValidator(record_key), *(run_schema_validator(r) for r in run_ids)]


# -- reading raw DHT results (pure): what a reader believes -----------------------------------------
def _subentries(found: ValueWithExpiration | None) -> dict[Any, Any]:
    if found is None or not isinstance(found.value, dict):
        return {}
    return found.value


def parse_manifests(run_id: str, found: ValueWithExpiration | None, seeder_public_key: str | None
                    ) -> list[RunManifest]:
    """One manifest per seeder key: the seeder's own record (its DHT signature makes it authentic) or,
    when that has expired or its storers left, the newest copy another member keeps under its own
    subkey whose embedded seeder signature verifies (:meth:`RunManifest.signature_ok`)."""
    return [m for m, _copies in _manifests_with_copies(run_id, found, seeder_public_key, time_now=None)]


def live_manifest_entries(run_id: str, found: ValueWithExpiration | None, seeder_public_key: str,
                          after: float) -> int:
    """How many believable stores of ``seeder_public_key``'s manifest (its own and copies) live past ``after``
    (DHT time)."""
    return sum(copies for _m, copies in _manifests_with_copies(run_id, found, seeder_public_key, time_now=after))


def _manifests_with_copies(run_id: str, found: ValueWithExpiration | None, seeder_public_key: str | None,
                           time_now: float | None) -> list[tuple[RunManifest, int]]:
    best: dict[str, tuple[tuple[bool, float], RunManifest]] = {}
    counts: dict[str, int] = {}
    for subkey, item in _subentries(found).items():
        owner = parse_owner_marker(subkey)
        if owner is None or item.value is None:
            continue
        try:
            m = RunManifest.from_wire(item.value)
        except RecordError as e:
            logger.debug("dropping malformed manifest of run %s: %s", run_id, e)
            continue
        if m.run_id != run_id or (seeder_public_key is not None and m.seeder_public_key != seeder_public_key):
            continue
        own = m.seeder_public_key.encode() == owner
        if not own and not m.signature_ok():
            logger.debug("dropping a copy of run %s's manifest: not signed by the seeder it names", run_id)
            continue
        k = m.seeder_public_key
        if time_now is None or item.expiration_time > time_now:
            counts[k] = counts.get(k, 0) + 1
        rank = (own, m.created_at)
        if k not in best or rank > best[k][0]:
            best[k] = (rank, m)
    return [(m, counts.get(k, 0)) for k, (_rank, m) in best.items()]


def parse_holders(
    run_id: str, found: ValueWithExpiration | None, config_hash: str
) -> dict[int, list[BlockAnnouncement]]:
    holders: dict[int, list[BlockAnnouncement]] = {}
    for subkey, item in _subentries(found).items():
        parsed = parse_block_subkey(subkey)
        if parsed is None or item.value is None:  # foreign subkey or tombstone
            continue
        block, owner = parsed
        try:
            ann = BlockAnnouncement.from_wire(item.value)
            signer = peer_id_from_public_key(owner)
        except (RecordError, IdentityError) as e:
            logger.debug("dropping malformed announcement in run %s: %s", run_id, e)
            continue
        if ann.peer_id != signer or ann.block_index != block or ann.run_id != run_id:
            logger.debug("dropping announcement of %s: signer %s / subkey block %d disagree",
                         ann.peer_id, signer, block)
            continue
        if ann.config_hash != config_hash or not ann.is_live:
            continue
        holders.setdefault(block, []).append(ann)
    for anns in holders.values():
        anns.sort(key=lambda a: a.peer_id)
    return dict(sorted(holders.items()))
