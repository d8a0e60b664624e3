"""Typed records the nodes publish in the DHT: the run manifest and per-block announcements.

These are the public (pydantic 2) models. ``to_wire()`` gives the plain dict stored in the DHT; the
strict schema every DHT node enforces on that dict lives in :mod:`blocktrain.p2p.dht_schema`.
"""
from __future__ import annotations

import math
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blocktrain.p2p.errors import RecordError

__all__ = [
    "RunManifest", "BlockAnnouncement", "BlockState", "PROTOCOL_VERSION", "RUN_ID_RE",
    "validate_run_id", "RecordError",
]

PROTOCOL_VERSION = 1
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
CONFIG_HASH_RE = r"^[0-9a-f]{8,64}$"
MAX_ADDRESSES = 8
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
    """Published once by the seeding researcher; defines the run every node must match."""

    run_id: str
    model_config_dict: dict[str, Any] = Field(alias="model_config")
    config_hash: str = Field(pattern=CONFIG_HASH_RE)
    data_spec: str = Field(max_length=4096)
    target_seed: int
    protocol_version: int = PROTOCOL_VERSION
    seeder_public_key: str = Field(max_length=2048)
    created_at: float = Field(default_factory=time.time)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=())

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python", by_alias=True)


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
