"""Checkpoints: one safetensors file per block, written atomically, checked when loaded.

File layout of a checkpoint directory::

    config.json                      the run's ModelConfig (save_config)
    block00.safetensors ...          one file per block (save_block / block_filename)
    block00.optim-<sha16>.pt         optional optimizer state of block 0 (torch.save)
    reference.safetensors            optional end-to-end reference model (save_reference)

Every ``.safetensors`` file carries string metadata: ``format`` ("blocktrain-block"),
``format_version`` ("1"), ``kind`` ("block" or "reference"), ``config_hash``,
``block_index`` (-1 for a reference), ``step``, ``samples_seen``, ``objective``, ``config``
(the full config JSON), ``saved_at``, plus caller-supplied extra string entries.

Atomicity: every file is written with ``atomic.py`` (a temporary file in the same directory,
flushed and fsynced, moved into place with ``os.replace``, the directory fsynced); a crash leaves
either the old or the new file, never a half one. Optimizer state is not a flat tensor
dict, so it lives in its own file named by its content hash and referenced (name and
sha256) from the weights' metadata: it is written before the weights, so until the new
weights are in place the old weights still point at the old, untouched optimizer file;
stale optimizer files are removed only after the new weights are durable.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .atomic import atomic_write, atomic_write_named, write_bytes
from .config import ConfigError, ModelConfig

__all__ = [
    "CheckpointError", "BlockCheckpoint", "FORMAT", "FORMAT_VERSION", "CONFIG_FILENAME",
    "REFERENCE_FILENAME", "block_filename", "save_block", "load_block", "save_reference",
    "load_reference", "save_config", "load_checkpoint_dir",
]

FORMAT = "blocktrain-block"
FORMAT_VERSION = "1"
SUPPORTED_VERSIONS = frozenset({FORMAT_VERSION})
CONFIG_FILENAME = "config.json"
REFERENCE_FILENAME = "reference.safetensors"
KIND_BLOCK = "block"
KIND_REFERENCE = "reference"

_RESERVED = frozenset({
    "format", "format_version", "kind", "config_hash", "block_index", "step", "samples_seen",
    "objective", "config", "saved_at", "optimizer_file", "optimizer_sha256",
})
_INT_FIELDS = ("block_index", "step", "samples_seen")
_BLOCK_RE = re.compile(r"block(\d+)\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or used; the message names the file and the problem."""


def block_filename(b: int) -> str:
    """``block_filename(3) == 'block03.safetensors'``."""
    return f"block{int(b):02d}.safetensors"


@dataclass
class BlockCheckpoint:
    """A loaded block (or reference) checkpoint.

    ``meta`` holds typed fields (``step``, ``samples_seen``, ``block_index``: int;
    ``format_version``: int; ``config_hash``, ``objective``, ``kind``, ``saved_at``: str) and
    any extra string entries given at save time. The stored config JSON is parsed into
    ``config``.
    """

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    config: ModelConfig
    optimizer_state: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def samples_seen(self) -> int:
        return self.meta["samples_seen"]

    @property
    def block_index(self) -> int:
        return self.meta["block_index"]

    @property
    def config_hash(self) -> str:
        return self.meta["config_hash"]

    @property
    def kind(self) -> str:
        return self.meta["kind"]


# --------------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------------
def _prepare_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, detached, contiguous tensors that own their storage exclusively (safetensors
    refuses shared or partial storages); tensors are cloned only where needed."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in state_dict.items():
        if not isinstance(key, str):
            raise CheckpointError(f"state_dict key {key!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state_dict[{key!r}] is {type(t).__name__}, not a tensor")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.numel() == 0:
            out[key] = t.clone()
            continue
        storage = t.untyped_storage()
        if (not t.is_contiguous() or t.storage_offset() != 0
                or storage.nbytes() != t.numel() * t.element_size()
                or storage.data_ptr() in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


class _HashingWriter:
    """A binary file that hashes what goes through it (torch.save writes a record at a time)."""

    def __init__(self, f) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _save_hashed(obj, tmp: Path) -> str:
    """``torch.save`` straight into ``tmp`` (no in-memory copy of the whole state: for a block's AdamW
    moments that copy was twice the block's size); returns its sha256."""
    with open(tmp, "xb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        w.flush()
    return w.sha.hexdigest()


def _optimizer_glob(path: Path) -> str:
    return glob.escape(path.stem) + ".optim-*.pt"


def _save(path: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], *, config: ModelConfig,
          kind: str, block_index: int, step: int, samples_seen: int,
          extra_meta: dict[str, str] | None, optimizer_state: dict | None) -> Path:
    path = Path(path)
    if not isinstance(config, ModelConfig):
        raise CheckpointError(f"{path}: config must be a ModelConfig, got {type(config).__name__}")
    if kind == KIND_BLOCK and not (isinstance(block_index, int) and 0 <= block_index < config.n_blocks):
        raise CheckpointError(f"{path}: block_index must be in [0, {config.n_blocks}), got {block_index!r}")
    for name, value in (("step", step), ("samples_seen", samples_seen)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{path}: {name} must be a non-negative int, got {value!r}")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "config_hash": config.config_hash,
        "block_index": str(block_index),
        "step": str(step),
        "samples_seen": str(samples_seen),
        "objective": config.objective,
        "config": config.to_json(),
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for k, v in (extra_meta or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"{path}: extra_meta entries must be str -> str, got {k!r}: {v!r}")
        if k in _RESERVED:
            raise CheckpointError(f"{path}: extra_meta key {k!r} is reserved")
        meta[k] = v
    tensors = _prepare_tensors(state_dict)

    optim_path: Path | None = None
    optim_created = False
    if optimizer_state is not None:
        optim_path, digest, optim_created = atomic_write_named(
            path.with_name(f"{path.stem}.optim.pt"), lambda tmp: _save_hashed(optimizer_state, tmp),
            lambda digest: path.with_name(f"{path.stem}.optim-{digest[:16]}.pt"))
        meta["optimizer_file"] = optim_path.name
        meta["optimizer_sha256"] = digest

    try:
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    except BaseException:
        if optim_created and optim_path is not None:  # the old weights never referenced it
            with contextlib.suppress(OSError):
                optim_path.unlink()
        raise
    # the new weights are durable: optimizer files they do not reference are stale
    for old in path.parent.glob(_optimizer_glob(path)):
        if optim_path is None or old.name != optim_path.name:
            with contextlib.suppress(OSError):
                old.unlink()
    return path


def save_block(path: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], *, config: ModelConfig,
               block_index: int, step: int, samples_seen: int,
               extra_meta: dict[str, str] | None = None, optimizer_state: dict | None = None) -> Path:
    """Atomically write block ``block_index``'s weights (and optional optimizer state)."""
    return _save(path, state_dict, config=config, kind=KIND_BLOCK, block_index=block_index, step=step,
                 samples_seen=samples_seen, extra_meta=extra_meta, optimizer_state=optimizer_state)


def save_reference(path: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], *, config: ModelConfig,
                   step: int, samples_seen: int, extra_meta: dict[str, str] | None = None,
                   optimizer_state: dict | None = None) -> Path:
    """Atomically write an end-to-end reference model (``kind="reference"``, block_index -1)."""
    return _save(path, state_dict, config=config, kind=KIND_REFERENCE, block_index=-1, step=step,
                 samples_seen=samples_seen, extra_meta=extra_meta, optimizer_state=optimizer_state)


def save_config(directory: str | os.PathLike[str], config: ModelConfig) -> Path:
    """Atomically write ``DIR/config.json``."""
    path = Path(directory) / CONFIG_FILENAME
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, write_bytes(text.encode("utf-8")))
    return path


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def _parse_meta(path: Path, raw: dict[str, str] | None) -> tuple[dict[str, Any], ModelConfig]:
    raw = dict(raw or {})
    fmt = raw.get("format")
    if fmt != FORMAT:
        found = "no 'format' entry" if fmt is None else f"format={fmt!r}"
        raise CheckpointError(f"{path}: not a BlockTrain checkpoint (safetensors metadata has {found}, "
                              f"expected format={FORMAT!r})")
    version = raw.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(f"{path}: unsupported checkpoint format version {version!r} "
                              f"(this BlockTrain reads version {', '.join(sorted(SUPPORTED_VERSIONS))})")
    missing = [k for k in ("kind", "config_hash", "config", *_INT_FIELDS) if k not in raw]
    if missing:
        raise CheckpointError(f"{path}: checkpoint metadata lacks {', '.join(missing)}")
    meta: dict[str, Any] = {k: v for k, v in raw.items() if k != "config"}
    meta["format_version"] = int(version)
    for k in _INT_FIELDS:
        try:
            meta[k] = int(raw[k])
        except ValueError:
            raise CheckpointError(f"{path}: metadata {k}={raw[k]!r} is not an integer") from None
    try:
        config = ModelConfig.from_dict(json.loads(raw["config"]), source=f"{path} (stored config)")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: stored config is not valid JSON ({e})") from None
    except ConfigError as e:
        raise CheckpointError(f"{path}: stored config is not usable by this BlockTrain: {e}") from None
    if config.config_hash != raw["config_hash"]:
        raise CheckpointError(f"{path}: metadata is inconsistent: config_hash {raw['config_hash']} but the "
                              f"stored config hashes to {config.config_hash}")
    return meta, config


def _load_optimizer(path: Path, meta: dict[str, Any], map_location: str) -> dict[str, Any]:
    """The optimizer state beside ``path``: hashed as it streams from its file, then loaded from the same
    open file (no copy of its bytes in memory: a resume peaks at the state itself). The file is named by
    its hash and never rewritten in place (``atomic_write_named``), so the bytes loaded are those hashed."""
    opath = path.parent / meta["optimizer_file"]
    try:
        with open(opath, "rb") as f:
            sha = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
            if sha.hexdigest() != meta.get("optimizer_sha256"):
                raise CheckpointError(f"{opath}: optimizer state does not match its checkpoint {path.name} "
                                      "(sha256 differs: corrupted or replaced)")
            f.seek(0)
            try:
                return torch.load(f, map_location=map_location, weights_only=True)
            except OSError:
                raise
            except Exception as e:
                raise CheckpointError(f"{opath}: cannot load optimizer state ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: its optimizer state file {opath.name} cannot be read "
                              f"({e.strerror or e})") from None


def _load(path: str | os.PathLike[str], *, kind: str, expected_config_hash: str | None,
          expected_block: int | None, map_location: str | torch.device, load_optimizer: bool) -> BlockCheckpoint:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint file not found")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file")
    device = str(torch.device(map_location))
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            meta, config = _parse_meta(path, f.metadata())
            # identity checks before the (possibly large) tensor reads
            if meta["kind"] != kind:
                raise CheckpointError(f"{path}: holds a {meta['kind']} checkpoint, expected a {kind}")
            if expected_config_hash is not None and meta["config_hash"] != expected_config_hash:
                raise CheckpointError(f"{path}: trained under config {meta['config_hash']}, "
                                      f"this run is {expected_config_hash}")
            if kind == KIND_BLOCK and not 0 <= meta["block_index"] < config.n_blocks:
                raise CheckpointError(f"{path}: block_index {meta['block_index']} outside [0, {config.n_blocks})")
            if expected_block is not None and meta["block_index"] != expected_block:
                raise CheckpointError(f"{path}: holds block {meta['block_index']}, expected block {expected_block}")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupted?): "
                              f"{type(e).__name__}: {e}") from None
    optimizer_state = None
    if load_optimizer and "optimizer_file" in meta:
        optimizer_state = _load_optimizer(path, meta, device)
    return BlockCheckpoint(path, tensors, meta, config, optimizer_state)


def load_block(path: str | os.PathLike[str], *, expected_config_hash: str | None = None,
               expected_block: int | None = None, map_location: str | torch.device = "cpu",
               load_optimizer: bool = True) -> BlockCheckpoint:
    """Load and check one block file; raises :class:`CheckpointError` naming the file."""
    return _load(path, kind=KIND_BLOCK, expected_config_hash=expected_config_hash,
                 expected_block=expected_block, map_location=map_location, load_optimizer=load_optimizer)


def load_reference(path: str | os.PathLike[str], *, expected_config_hash: str | None = None,
                   map_location: str | torch.device = "cpu", load_optimizer: bool = True) -> BlockCheckpoint:
    """Load and check a reference-model file written by :func:`save_reference`."""
    return _load(path, kind=KIND_REFERENCE, expected_config_hash=expected_config_hash,
                 expected_block=None, map_location=map_location, load_optimizer=load_optimizer)


def load_checkpoint_dir(directory: str | os.PathLike[str], *, expected_config_hash: str | None = None,
                        require_all: bool = True, load_optimizer: bool = False,
                        map_location: str | torch.device = "cpu") -> tuple[ModelConfig, dict[int, BlockCheckpoint]]:
    """Load ``config.json`` (if present) and every ``blockNN.safetensors`` of a directory.

    Every block must belong to the same config (config.json's, else the first block's);
    with ``require_all`` every block 0..n_blocks-1 must be present.
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: checkpoint directory not found")
    files: dict[int, Path] = {}
    for p in d.iterdir():
        m = _BLOCK_RE.fullmatch(p.name)
        if m:
            files[int(m.group(1))] = p
    config: ModelConfig | None = None
    origin = ""
    cfg_path = d / CONFIG_FILENAME
    if cfg_path.is_file():
        try:
            config = ModelConfig.load(cfg_path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None   # its message names the file
        origin = str(cfg_path)
    elif not files:
        raise CheckpointError(f"{d}: no {CONFIG_FILENAME} and no block files (blockNN.safetensors)")

    blocks: dict[int, BlockCheckpoint] = {}
    for b in sorted(files):
        ck = load_block(files[b], expected_block=b, map_location=map_location, load_optimizer=load_optimizer)
        if config is None:
            config, origin = ck.config, str(files[b])
        elif ck.config_hash != config.config_hash:
            raise CheckpointError(f"{files[b]}: trained under config {ck.config_hash}, but {origin} "
                                  f"is config {config.config_hash}")
        blocks[b] = ck
    assert config is not None
    if expected_config_hash is not None and config.config_hash != expected_config_hash:
        raise CheckpointError(f"{d}: checkpoints were trained under config {config.config_hash}, "
                              f"this run is {expected_config_hash}")
    missing = [b for b in range(config.n_blocks) if b not in blocks]
    if missing and require_all:
        names = ", ".join(block_filename(b) for b in missing)
        raise CheckpointError(f"{d}: missing {len(missing)} of {config.n_blocks} block(s): "
                              f"{', '.join(map(str, missing))} ({names})")
    return config, blocks
