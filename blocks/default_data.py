"""The swarm's default data source: works offline on a fresh machine, says what it is.

Order: the WikiText-2 raw folder of this project's shared data (``../shared/data/wikitext-2-raw``
next to the working directory or the source checkout), then WikiText-2 from Hugging Face when
``datasets`` and a network are available, then the text of this Python's standard library
(real text present on every machine, mostly source code: enough to show training works).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

from blocktrain.blocks.data import HF_DATASETS, DataError, DataSplit, resolve_data

AUTO = "auto"


def _shared_wikitext() -> Path | None:
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *Path.cwd().parents[:2], here.parents[1], here.parents[2]):
        p = base / "shared" / "data" / "wikitext-2-raw"
        if (p / "wiki.test.raw").exists():
            return p
        p = base.parent / "shared" / "data" / "wikitext-2-raw"
        if (p / "wiki.test.raw").exists():
            return p
    return None


def stdlib_text_file(cache_dir: Path, max_bytes: int = 4_000_000) -> Path:
    """Concatenate the standard library's .py files (sorted, up to max_bytes) into one text file."""
    out = Path(cache_dir) / "python-stdlib.txt"
    if out.exists() and out.stat().st_size > 0:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for f in sorted(root.glob("*.py")):
        b = f.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(b"\n".join(chunks))
    tmp.replace(out)
    return out


def resolve_default(spec: str, seq_len: int, cache_dir: Path, *,
                    file_backed: bool = False) -> tuple[DataSplit, str]:
    """Resolve ``spec`` (``auto`` or any SRC) to a split; returns (split, the spec actually used).
    ``file_backed``: as :func:`~blocktrain.blocks.data.resolve_data` (training bytes left on disk)."""
    fb = {"seq_len": seq_len, "file_backed": file_backed}
    if spec != AUTO:
        return resolve_data(spec, **fb), spec
    wt = _shared_wikitext()
    if wt is not None:
        return resolve_data(str(wt), **fb), str(wt)
    try:
        return resolve_data("wikitext-2", **fb), "wikitext-2"
    except DataError:
        f = stdlib_text_file(cache_dir)
        return resolve_data(str(f), **fb), str(f)


def is_dataset_name(spec: str) -> bool:
    """A public dataset known by name (``wikitext-2``, ``wikitext-103``, ...), as opposed to a path."""
    return spec in HF_DATASETS


def resolve_named(name: str, seq_len: int, cache_dir: Path, *,
                  file_backed: bool = False) -> tuple[DataSplit, str]:
    """Resolve ``auto`` or a dataset NAME through this machine's own known sources (the shared
    WikiText-2 copy, Hugging Face ``datasets``): never as a path, whatever files exist here."""
    if name == AUTO:
        return resolve_default(AUTO, seq_len, cache_dir, file_backed=file_backed)
    if not is_dataset_name(name):
        raise DataError(f"{name!r} is not a known dataset name ({', '.join(sorted(HF_DATASETS))})")
    wt = _shared_wikitext()
    if wt is not None and HF_DATASETS[name] == "wikitext-2-raw-v1":
        return resolve_data(str(wt), seq_len=seq_len, file_backed=file_backed), str(wt)
    return resolve_data(name, seq_len=seq_len, dataset_only=True), name
