"""The run index: one DHT key listing live runs, so ``bt-node join --initial-peers X`` needs no run id.

Key ``blocktrain_runs``; subkey = ``b"<run id>" + owner marker`` (signed by the seeder, so nobody
can overwrite another seeder's entry); value = ``{"run_id", "config_hash", "created_at"}``. The
schema is enforced by every node. An entry expires with the manifest's TTL.
"""
from __future__ import annotations

import re
from typing import Any, Dict

import pydantic.v1 as pv1
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.timed_storage import ValueWithExpiration

RUNS_KEY = "blocktrain_runs"
_RUN = pv1.constr(strict=True, regex=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_SUBKEY_RE = re.compile(rb"^([A-Za-z0-9][A-Za-z0-9_-]{0,63})\[owner:.+\]$", re.DOTALL)


class RunIndexEntry(pv1.BaseModel):
    run_id: _RUN
    config_hash: pv1.constr(strict=True, regex=r"^[0-9a-f]{8,64}$")
    created_at: pv1.confloat(strict=True, allow_inf_nan=False)

    class Config:
        extra = pv1.Extra.forbid


class RunIndexSchema(pv1.BaseModel):
    blocktrain_runs: Dict[BytesWithPublicKey, RunIndexEntry]


def run_index_validator() -> SchemaValidator:
    return SchemaValidator(RunIndexSchema, allow_extra_keys=True)


def run_subkey(run_id: str, marker: bytes) -> bytes:
    return run_id.encode() + marker


def parse_run_index(found: ValueWithExpiration | None) -> list[str]:
    """Run ids listed under the index (entries whose subkey and value agree)."""
    if found is None or not isinstance(found.value, dict):
        return []
    runs = set()
    for subkey, item in found.value.items():
        value: Any = getattr(item, "value", None)
        m = _SUBKEY_RE.match(subkey) if isinstance(subkey, bytes) else None
        if m and isinstance(value, dict) and value.get("run_id") == m.group(1).decode():
            runs.add(value["run_id"])
    return sorted(runs)
