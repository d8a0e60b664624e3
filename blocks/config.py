"""Model and run configuration: one frozen dataclass, loaded from TOML/JSON, validated, hashed.

The config hash identifies a run: every node of a network must hold the same hash, and every
checkpoint records it, so a block trained under one config is never loaded under another.
Only fields that change the model's math enter the hash (``HASHED_FIELDS``); budgets, batch
sizes and seeds of local sampling do not.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    # model shape
    vocab_size: int = 256
    d_model: int = 192
    n_heads: int = 4
    layers_per_block: int = 2
    n_blocks: int = 4
    seq_len: int = 256
    target_dim: int = 64
    mlp_ratio: int = 4
    dropout: float = 0.0
    # objective
    objective: str = "paper"
    # noise schedule (EDM, Karras et al. 2022)
    sigma_min: float = 1.0
    sigma_max: float = 10.0
    p_mean: float = -1.2
    p_std: float = 1.2
    # per-coordinate std of the target rows (unit-norm rows at target_dim 64). With 0.5 (norm 4)
    # sigma in [1, 10] leaks the answer to the low-noise blocks and the chain breaks (BENCHMARKS.md)
    sigma_data: float = 0.125
    overlap: float = 0.0
    # chunked objectives (issue 8): chunk length in bytes
    chunk_len: int = 16
    # seeds
    target_seed: int = 1234
    init_seed: int = 0
    # local training
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    grad_clip: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    # -- derived ---------------------------------------------------------------------------
    @property
    def reference_layers(self) -> int:
        """Layers of the end-to-end reference with the same total depth as the chain."""
        return self.n_blocks * self.layers_per_block

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def config_hash(self) -> str:
        """Stable 16-hex-digit hash over the fields that define the model's math."""
        d = self.to_dict()
        payload = {k: d[k] for k in HASHED_FIELDS}
        payload["extra"] = d["extra"]
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a table/object of fields, got {type(d).__name__}")
        d = dict(d.get("model", d)) if isinstance(d.get("model"), dict) else dict(d)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}")
        for name, value in d.items():
            expected = _FIELD_TYPES[name]
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                d[name] = float(value)
            elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(
                    f"{source}: field '{name}' must be {expected.__name__}, got {value!r}"
                )
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(cls.read(path), source=str(path))

    @staticmethod
    def read(path: str | Path) -> Any:
        """A config file's contents as written (TOML or JSON), not yet checked (:meth:`from_dict` does)."""
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file ({e.strerror})") from None
        try:
            if path.suffix == ".toml":
                data = tomllib.loads(text.decode("utf-8"))
            else:
                data = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({e})") from None
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


HASHED_FIELDS = (
    "vocab_size", "d_model", "n_heads", "layers_per_block", "n_blocks", "seq_len", "target_dim",
    "mlp_ratio", "objective", "sigma_min", "sigma_max", "p_mean", "p_std", "sigma_data",
    "overlap", "chunk_len", "target_seed",
)

_FIELD_TYPES: dict[str, type] = {
    f.name: (dict if f.name == "extra" else type(f.default)) for f in dataclasses.fields(ModelConfig)
}


def _need(cond: bool, fieldname: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"field '{fieldname}' {msg}")


def validate(c: ModelConfig) -> None:
    _need(c.vocab_size == 256, "vocab_size", "must be 256 (the model reads raw bytes)")
    _need(c.d_model >= 8, "d_model", f"must be >= 8, got {c.d_model}")
    _need(c.n_heads >= 1, "n_heads", f"must be >= 1, got {c.n_heads}")
    _need(c.d_model % c.n_heads == 0, "d_model", f"({c.d_model}) must be divisible by n_heads ({c.n_heads})")
    _need(c.layers_per_block >= 1, "layers_per_block", f"must be >= 1, got {c.layers_per_block}")
    _need(1 <= c.n_blocks <= 64, "n_blocks", f"must be in [1, 64], got {c.n_blocks}")
    _need(2 <= c.seq_len <= 65536, "seq_len", f"must be in [2, 65536], got {c.seq_len}")
    _need(c.target_dim >= 2, "target_dim", f"must be >= 2, got {c.target_dim}")
    _need(c.mlp_ratio >= 1, "mlp_ratio", f"must be >= 1, got {c.mlp_ratio}")
    _need(0.0 <= c.dropout < 1.0, "dropout", f"must be in [0, 1), got {c.dropout}")
    _need(isinstance(c.objective, str) and c.objective != "", "objective", "must be a non-empty name")
    for name in ("sigma_min", "sigma_max", "p_mean", "p_std", "sigma_data", "overlap", "lr",
                 "weight_decay", "grad_clip"):
        v = getattr(c, name)
        _need(isinstance(v, (int, float)) and math.isfinite(v), name, f"must be a finite number, got {v!r}")
    _need(c.sigma_min > 0, "sigma_min", f"must be > 0, got {c.sigma_min}")
    _need(c.sigma_max > c.sigma_min, "sigma_max", f"({c.sigma_max}) must be > sigma_min ({c.sigma_min})")
    _need(c.p_std > 0, "p_std", f"must be > 0, got {c.p_std}")
    _need(c.sigma_data > 0, "sigma_data", f"must be > 0, got {c.sigma_data}")
    _need(0.0 <= c.overlap < 1.0, "overlap", f"must be in [0, 1), got {c.overlap}")
    _need(1 <= c.chunk_len <= c.seq_len, "chunk_len", f"must be in [1, seq_len], got {c.chunk_len}")
    _need(c.batch_size >= 1, "batch_size", f"must be >= 1, got {c.batch_size}")
    _need(c.lr > 0, "lr", f"must be > 0, got {c.lr}")
    _need(c.weight_decay >= 0, "weight_decay", f"must be >= 0, got {c.weight_decay}")
    _need(c.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {c.warmup_steps}")
    _need(c.grad_clip > 0, "grad_clip", f"must be > 0, got {c.grad_clip}")
