"""Byte streams for training and evaluation.

A data source (``SRC``) is one of

1. a file: its raw bytes;
2. a WikiText raw folder (holds ``wiki.train.raw`` / ``wiki.valid.raw`` / ``wiki.test.raw``);
3. a folder with ``train.txt`` (and usually ``test.txt``), such as the Gutenberg corpus;
4. any other folder of text files: ``*.txt``, ``*.raw``, ``*.md``, ... sorted by name, joined
   with ``b"\\n"``; binary files are skipped;
5. ``wikitext-2`` / ``wikitext-103``: the Hugging Face ``datasets`` copy (network or cache
   needed; ``datasets`` is imported only here). An existing path of that name wins.

:func:`load_source` reads a source into a :class:`ByteCorpus`; :func:`resolve_data` turns a
source (plus an optional evaluation source) into a :class:`DataSplit` of train and evaluation
bytes with a protocol label that must be reported next to every figure.

How windows of bytes are cut from them for training and evaluation lives in ``windows.py``.

``file_backed=True`` (what a node asks for) leaves the training bytes of a single file on disk: a
:class:`FileBytes` reads each window when it is drawn (``os.pread``), so a node holds none of its
corpus in memory (a pipeline stage that draws no window never reads it); evaluation bytes, small
and read over and over, are always held in memory.
"""
from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "DataError", "ByteCorpus", "DataSplit", "HF_DATASETS", "TEXT_SUFFIXES",
    "load_source", "resolve_data", "describe_bytes", "carve_validation", "FileBytes", "sha256_of",
    "gather_windows",
]


class DataError(ValueError):
    """A data source cannot be used; the message names the path or source."""


#: dataset names resolved through Hugging Face ``datasets`` -> (dataset, config)
HF_DATASETS: dict[str, str] = {
    "wikitext-2": "wikitext-2-raw-v1",
    "wikitext-2-raw-v1": "wikitext-2-raw-v1",
    "wikitext-103": "wikitext-103-raw-v1",
    "wikitext-103-raw-v1": "wikitext-103-raw-v1",
}

#: suffixes read from a plain folder of text files ("" = no suffix, e.g. README)
TEXT_SUFFIXES = frozenset({".txt", ".raw", ".md", ".markdown", ".rst", ".text", ".tokens", ".tex", ".org", ""})

_WIKI_FILES = {"train": "wiki.train.raw", "valid": "wiki.valid.raw", "test": "wiki.test.raw"}
_WT2_TRAIN_BYTES = 10_940_747          # canonical wiki.train.raw of WikiText-2 (raw, v1)
_WT103_MIN_TRAIN_BYTES = 100_000_000   # WikiText-103's train split is ~540 MB
_BINARY_PROBE = 8192                   # bytes inspected for a NUL to call a file binary


def describe_bytes(n: int) -> str:
    """``describe_bytes(1146846) == '1.15 MB (1,146,846 bytes)'``; small counts stay exact."""
    n = int(n)
    if n < 1000:
        return f"{n} byte" + ("" if n == 1 else "s")
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,} bytes)"
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ByteCorpus:
    """The bytes of one source.

    ``splits`` maps a split name to a uint8 array: ``"all"`` for a file or a folder of text
    files; ``"train"`` / ``"valid"`` / ``"test"`` (those present) for a WikiText raw folder,
    a train.txt/test.txt folder or a Hugging Face dataset. ``labels`` names where each split
    came from (used in protocol strings).
    """

    name: str
    kind: str  # "file" | "folder" | "wikitext-raw" | "train-test" | "hf"
    splits: dict[str, np.ndarray]
    labels: dict[str, str]
    source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return int(sum(len(a) for a in self.splits.values()))

    def eval_part(self) -> tuple[np.ndarray, str]:
        """The bytes this source contributes when given as an evaluation source."""
        for split in ("all", "test", "valid"):
            if split in self.splits:
                return self.splits[split], self.labels[split]
        raise DataError(f"{self.source}: has no test or valid split to evaluate on "
                        f"(found: {', '.join(sorted(self.splits))})")


class _OpenFile:
    """One open file descriptor shared by a :class:`FileBytes` and its slices; closed when the last
    of them is collected. Records the file's size and modification time at open: a read that finds
    either changed (the file was truncated or rewritten in place) raises :class:`DataError` instead
    of training on other bytes, or on none (a file replaced by a rename is not seen: the open file
    keeps the bytes it had)."""

    def __init__(self, path: Path) -> None:
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
        weakref.finalize(self, os.close, self.fd)
        st = os.fstat(self.fd)
        self.path, self.size, self.mtime_ns = path, st.st_size, st.st_mtime_ns

    def check(self) -> None:
        try:
            st = os.fstat(self.fd)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if (st.st_size, st.st_mtime_ns) != (self.size, self.mtime_ns):
            raise DataError(f"{self.path}: the file changed after it was opened ({describe_bytes(self.size)} "
                            f"then, {describe_bytes(st.st_size)} now); restart to train on the new bytes")

    def read(self, offset: int, n: int) -> bytes:
        try:
            blob = os.pread(self.fd, n, offset)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if len(blob) != n:
            self.check()
            raise DataError(f"{self.path}: short read at byte {offset:,} ({len(blob)} of {n}); "
                            "the file changed after it was opened")
        return blob


class FileBytes:
    """The bytes ``[start, stop)`` of a file, read when asked for instead of held in memory.

    Enough of a 1-D uint8 array for this package: ``len``, integer and contiguous-slice indexing
    (a slice is another view of the same open file), :func:`gather_windows`, :func:`sha256_of`, and
    ``np.asarray`` (which reads the whole range into memory). Reads are positional (``os.pread``):
    safe from any thread. Each batch of windows first checks the file is unchanged (one ``fstat``).
    """

    def __init__(self, path: str | os.PathLike[str], *, _file: _OpenFile | None = None,
                 _start: int = 0, _stop: int | None = None) -> None:
        self._file = _file or _OpenFile(Path(path))
        self.start = _start
        self.stop = self._file.size if _stop is None else _stop

    @property
    def path(self) -> Path:
        return self._file.path

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"FileBytes({str(self.path)!r}, bytes {self.start:,}..{self.stop:,})"

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise TypeError("FileBytes: only contiguous slices (step 1)")
            hi = max(lo, hi)
            return FileBytes(self.path, _file=self._file, _start=self.start + lo, _stop=self.start + hi)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {int(key)} out of range for {len(self)} bytes")
            return self._file.read(self.start + i, 1)[0]
        raise TypeError(f"FileBytes: index with an int or a slice (got {type(key).__name__}); "
                        "use gather_windows for windows")

    def read(self, lo: int = 0, hi: int | None = None) -> bytes:
        """The bytes ``[lo, hi)`` of this view."""
        hi = len(self) if hi is None else hi
        self._file.check()
        return self._file.read(self.start + lo, hi - lo)

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """``(len(starts), width)`` uint8: the ``width`` bytes at each start (of this view)."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + width > len(self)):
            raise IndexError(f"windows of {width} bytes at starts {starts.min()}..{starts.max()} "
                             f"fall outside {len(self)} bytes")
        self._file.check()
        out = np.empty((starts.size, width), dtype=np.uint8)
        for row, s in enumerate(starts.tolist()):
            out[row] = np.frombuffer(self._file.read(self.start + s, width), dtype=np.uint8)
        return out

    def chunks(self, size: int = 1 << 20):
        """The bytes in order, ``size`` at a time (hashing without holding the file)."""
        self._file.check()
        for lo in range(0, len(self), size):
            yield self._file.read(self.start + lo, min(size, len(self) - lo))

    def tobytes(self) -> bytes:
        return self.read()

    def __array__(self, dtype=None, copy=None):
        arr = np.frombuffer(bytearray(self.read()), dtype=np.uint8)
        return arr if dtype is None else arr.astype(dtype)


def gather_windows(data, starts: np.ndarray, width: int) -> np.ndarray:
    """``(len(starts), width)`` uint8 windows of ``data`` (an array or a :class:`FileBytes`)."""
    if isinstance(data, FileBytes):
        return data.windows(starts, width)
    return data[np.asarray(starts, dtype=np.int64)[:, None] + np.arange(width, dtype=np.int64)]


def sha256_of(data) -> str:
    """Hex sha256 of the bytes of ``data`` (an array or a :class:`FileBytes`, read a MiB at a time)."""
    if isinstance(data, FileBytes):
        h = hashlib.sha256()
        for blob in data.chunks():
            h.update(blob)
        return h.hexdigest()
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def _read_file(path: Path, file_backed: bool = False) -> np.ndarray | FileBytes:
    if file_backed:
        fb = FileBytes(path)
        if len(fb) == 0:
            raise DataError(f"{path}: file is empty")
        return fb
    try:
        arr = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if arr.size == 0:
        raise DataError(f"{path}: file is empty")
    return arr


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\x00" in f.read(_BINARY_PROBE)


def _load_folder(path: Path, file_backed: bool = False) -> ByteCorpus:
    name = path.name or str(path)
    wiki = {s: path / f for s, f in _WIKI_FILES.items() if (path / f).is_file()}
    if wiki:
        splits = {s: _read_file(p, file_backed) for s, p in wiki.items()}
        labels = {s: f"{name}/{p.name}" for s, p in wiki.items()}
        return ByteCorpus(name, "wikitext-raw", splits, labels, source=str(path))
    if (path / "train.txt").is_file():
        tt = {s: path / f"{s}.txt" for s in ("train", "valid", "test") if (path / f"{s}.txt").is_file()}
        splits = {s: _read_file(p, file_backed) for s, p in tt.items()}
        labels = {s: f"{name}/{p.name}" for s, p in tt.items()}
        return ByteCorpus(name, "train-test", splits, labels, source=str(path))

    try:
        entries = sorted(path.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise DataError(f"{path}: cannot list folder ({e.strerror or e})") from None
    parts: list[bytes] = []
    used: list[str] = []
    skipped: list[str] = []
    for p in entries:
        if p.name.startswith(".") or not p.is_file() or p.suffix.lower() not in TEXT_SUFFIXES:
            continue
        try:
            if _is_binary(p):
                skipped.append(p.name)
                continue
            blob = p.read_bytes()
        except OSError as e:
            raise DataError(f"{p}: cannot read ({e.strerror or e})") from None
        if blob:
            parts.append(blob)
            used.append(p.name)
    if not parts:
        extra = f"; skipped binary: {', '.join(skipped)}" if skipped else ""
        raise DataError(f"{path}: folder holds no non-empty text files "
                        f"(looked for {', '.join(sorted(s for s in TEXT_SUFFIXES if s))} "
                        f"or no suffix){extra}")
    arr = np.frombuffer(bytearray(b"\n".join(parts)), dtype=np.uint8)
    notes = (f"{len(used)} text file(s): {', '.join(used[:5])}{', ...' if len(used) > 5 else ''}",)
    if skipped:
        notes += (f"skipped {len(skipped)} binary file(s): {', '.join(skipped)}",)
    return ByteCorpus(name, "folder", {"all": arr}, {"all": name}, source=str(path), notes=notes)


def _load_hf(src: str) -> ByteCorpus:
    config = HF_DATASETS[src]
    try:
        import datasets  # noqa: PLC0415 - optional, only for this source
    except ImportError:
        raise DataError(
            f"{src}: needs the Hugging Face 'datasets' package (pip install 'blocktrain[hf]') "
            "and a network; offline, pass a folder of WikiText raw files instead "
            "(e.g. ../shared/data/wikitext-2-raw)") from None
    try:
        ds = datasets.load_dataset("wikitext", config)
    except Exception as e:  # network errors, hub errors, missing cache: all the same to a user
        raise DataError(
            f"{src}: could not load Hugging Face dataset wikitext/{config} "
            f"({type(e).__name__}: {e}); it needs a network or a local cache; offline, pass a "
            "folder of WikiText raw files instead (e.g. ../shared/data/wikitext-2-raw)") from None
    splits: dict[str, np.ndarray] = {}
    labels: dict[str, str] = {}
    for hf_split, ours in (("train", "train"), ("validation", "valid"), ("test", "test")):
        if hf_split not in ds:
            continue
        text = "".join(ds[hf_split]["text"])  # rows keep their "\n": this reproduces the raw file
        splits[ours] = np.frombuffer(bytearray(text.encode("utf-8")), dtype=np.uint8)
        labels[ours] = f"{config}:{hf_split}"
    for needed in ("train", "test"):
        if needed not in splits or len(splits[needed]) == 0:
            raise DataError(f"{src}: Hugging Face wikitext/{config} has no (or an empty) {needed} split")
    return ByteCorpus(config, "hf", splits, labels, source=src)


def load_source(src: str | os.PathLike[str], *, dataset_only: bool = False,
                file_backed: bool = False) -> ByteCorpus:
    """Read a data source (file, WikiText raw folder, train.txt/test.txt folder, folder of text
    files, or ``wikitext-2`` / ``wikitext-103``) into a :class:`ByteCorpus`. ``dataset_only``: a
    dataset name only, never a path (for names that came from the network). ``file_backed``: each
    split that is one whole file stays on disk as a :class:`FileBytes` (a folder of text files and
    a Hugging Face dataset are joined in memory all the same)."""
    text = os.fspath(src)
    if not text:
        raise DataError("empty data source (expected a file, a folder, or wikitext-2 / wikitext-103)")
    if dataset_only:
        if text not in HF_DATASETS:
            raise DataError(f"{text!r} is not a dataset name ({', '.join(sorted(HF_DATASETS))})")
        return _load_hf(text)
    path = Path(text).expanduser()
    if path.is_file():
        return ByteCorpus(path.name, "file", {"all": _read_file(path, file_backed)}, {"all": path.name},
                          source=str(path))
    if path.is_dir():
        return _load_folder(path, file_backed)
    if text in HF_DATASETS:
        return _load_hf(text)
    if path.exists():
        raise DataError(f"{path}: neither a regular file nor a folder")
    raise DataError(f"{path}: no such file or folder (and not a dataset name: "
                    f"{', '.join(sorted(k for k in HF_DATASETS if k.count('-') == 1))})")


# --------------------------------------------------------------------------------------------
# train / eval resolution
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSplit:
    """Train and evaluation bytes, and the protocol to report next to every figure."""

    train: np.ndarray
    eval: np.ndarray
    protocol: str
    description: str
    train_name: str = ""
    eval_name: str = ""
    notes: tuple[str, ...] = field(default=())
    #: sizes of the books ``train`` joins with b"\n", in order, when the source lists them (Gutenberg's
    #: MANIFEST.tsv); empty when unknown
    train_books: tuple[int, ...] = field(default=())


def _is_gutenberg(path: Path) -> bool:
    if "gutenberg" in path.resolve().name.lower():
        return True
    manifest = path / "MANIFEST.tsv"
    try:
        with open(manifest, "rb") as f:
            header = f.readline().decode("utf-8", "replace").lower().split("\t")
    except OSError:
        return False
    return "ebook" in header and "split" in header


def _manifest_train_books(folder: Path, n_train: int) -> tuple[int, ...]:
    """Train book sizes from ``MANIFEST.tsv`` (columns ``bytes`` and ``split``), if they add up to
    ``train.txt`` joined with one b"\n" between books; else ()."""
    try:
        with open(folder / "MANIFEST.tsv", encoding="utf-8") as f:
            header = f.readline().rstrip("\n").split("\t")
            i_bytes, i_split = header.index("bytes"), header.index("split")
            sizes = tuple(int(cols[i_bytes]) for cols in (line.rstrip("\n").split("\t") for line in f)
                          if len(cols) > max(i_bytes, i_split) and cols[i_split] == "train")
    except (OSError, ValueError, UnicodeDecodeError):
        return ()
    return sizes if sizes and sum(sizes) + len(sizes) - 1 == n_train else ()


def carve_validation(split: DataSplit, fraction: float = 0.025) -> tuple[DataSplit, DataSplit]:
    """Cut a validation part off the END of the training bytes (never from the evaluation bytes).

    Returns ``(training, validation)``: ``training`` trains on the head and keeps ``split``'s
    evaluation bytes; ``validation`` trains on the same head and evaluates on the tail. When the
    split knows its books (``train_books``) the tail is the fewest whole final books holding at least
    ``fraction`` of the bytes (as test holds out whole books); otherwise the last ``fraction``."""
    if not 0.0 < fraction < 0.5:
        raise DataError(f"validation fraction must be in (0, 0.5), got {fraction!r}")
    n = len(split.train)
    head_end = tail_start = n - int(round(n * fraction))
    what = f"last {_pct(fraction)} of the train bytes"
    if split.train_books:
        books, tail = 0, 0
        for size in reversed(split.train_books[1:]):
            books, tail = books + 1, tail + size + 1      # the book and the b"\n" before it
            if tail >= n * fraction:
                break
        head_end, tail_start, what = n - tail, n - tail + 1, f"last {books} train book(s)"
    if head_end < 2 or n - tail_start < 2:
        raise DataError(f"{split.train_name}: {describe_bytes(n)} is too small to carve a validation part")
    head, tail_bytes = split.train[:head_end], split.train[tail_start:]
    train_name = f"{split.train_name} without its {what}"
    training = DataSplit(head, split.eval, f"{split.protocol}; trained without the validation part",
                         f"train {train_name}: {describe_bytes(len(head))}; eval {split.eval_name}: "
                         f"{describe_bytes(len(split.eval))}", train_name, split.eval_name, split.notes)
    val_name = f"{split.train_name}[{what}]"
    validation = DataSplit(head, tail_bytes, f"{split.protocol}; validation = {what} (carved from train)",
                           f"train {train_name}: {describe_bytes(len(head))}; validation {val_name}: "
                           f"{describe_bytes(len(tail_bytes))}", train_name, val_name, split.notes)
    return training, validation


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


def resolve_data(src: str | os.PathLike[str], eval_src: str | os.PathLike[str] | None = None,
                 holdout: float = 0.05, *, seq_len: int | None = None, dataset_only: bool = False,
                 file_backed: bool = False) -> DataSplit:
    """Resolve train and evaluation bytes.

    - WikiText raw folder with ``wiki.train.raw``: train = train, eval = test
      (protocol ``wt2-raw`` / ``wt103-raw`` by size, else ``wikitext-raw:train/test``);
    - WikiText raw folder without train: train = ``wiki.valid.raw``, eval = ``wiki.test.raw``,
      protocol ``wt2-offline``;
    - folder with ``train.txt``/``test.txt``: ``gutenberg-offline`` for the Gutenberg corpus,
      else ``train.txt/test.txt``;
    - ``wikitext-2`` / ``wikitext-103``: HF train / test, ``wikitext-2-raw-v1 (HF train/test)``;
    - otherwise ``eval_src`` if given, else the LAST ``holdout`` fraction of the bytes.

    ``eval_src``, when given, always replaces the evaluation split
    (protocol ``train=NAME, eval=NAME``). With ``seq_len``, each split must hold at least one
    window of ``seq_len + 1`` bytes (a held-out source at least ``2 * seq_len + 2``).
    ``file_backed``: training bytes that are one whole file (or a part of one) stay on disk as a
    :class:`FileBytes`; the evaluation bytes are always read into memory.
    """
    if not (0.0 < holdout < 1.0):
        raise DataError(f"holdout must be in (0, 1), got {holdout!r}")
    if seq_len is not None and seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len!r}")
    window = (seq_len + 1) if seq_len is not None else 2
    corpus = load_source(src, dataset_only=dataset_only, file_backed=file_backed)
    s, lab = corpus.splits, corpus.labels

    evaluation: np.ndarray | None = None
    books: tuple[int, ...] = ()
    eval_name = ""
    protocol = ""
    if corpus.kind == "wikitext-raw":
        if "train" in s:
            train, train_name = s["train"], lab["train"]
            ev = "test" if "test" in s else ("valid" if "valid" in s else None)
            if ev is not None:
                evaluation, eval_name = s[ev], lab[ev]
                if ev == "test" and len(train) == _WT2_TRAIN_BYTES:
                    protocol = "wt2-raw"
                elif ev == "test" and len(train) >= _WT103_MIN_TRAIN_BYTES:
                    protocol = "wt103-raw"
                else:
                    protocol = f"wikitext-raw:train/{ev}"
        elif "valid" in s:
            train, train_name = s["valid"], lab["valid"]
            if "test" in s:
                evaluation, eval_name, protocol = s["test"], lab["test"], "wt2-offline"
        else:
            raise DataError(f"{corpus.source}: WikiText folder has only wiki.test.raw; nothing to train on "
                            "(need wiki.train.raw or wiki.valid.raw)")
    elif corpus.kind == "train-test":
        train, train_name = s["train"], lab["train"]
        if "test" in s:
            evaluation, eval_name = s["test"], lab["test"]
            protocol = "gutenberg-offline" if _is_gutenberg(Path(corpus.source)) else "train.txt/test.txt"
        books = _manifest_train_books(Path(corpus.source), len(train))
    elif corpus.kind == "hf":
        train, train_name = s["train"], lab["train"]
        evaluation, eval_name = s["test"], lab["test"]
        protocol = f"{corpus.name} (HF train/test)"
    else:
        train, train_name = s["all"], lab["all"]

    notes = corpus.notes
    if eval_src is not None:
        ec = load_source(eval_src)
        evaluation, eval_name = ec.eval_part()
        protocol = f"train={train_name}, eval={eval_name}"
        notes = notes + ec.notes
    elif evaluation is None:
        n = len(train)
        if n < 2 * window:
            raise DataError(f"{corpus.source}: too small to hold out an evaluation part: "
                            f"{describe_bytes(n)}, need at least {2 * window} bytes")
        n_eval = int(round(n * holdout))
        if n_eval < window or n - n_eval < window:
            raise DataError(f"{corpus.source}: holding out {_pct(holdout)} of {describe_bytes(n)} leaves "
                            f"{n - n_eval} train / {n_eval} eval bytes, need {window} each; "
                            "give a larger source, a different holdout, or --eval-data")
        # views (no copy) of the one array
        train, evaluation = train[: n - n_eval], train[n - n_eval:]
        protocol = f"{train_name} (last {_pct(holdout)} held out)"
        eval_name = f"{train_name}[last {_pct(holdout)}]"
        train_name = f"{train_name}[first {_pct(1 - holdout)}]"

    if isinstance(evaluation, FileBytes):
        evaluation = np.asarray(evaluation)   # small, and read window by window many times over
    for what, arr, name in (("train", train, train_name), ("eval", evaluation, eval_name)):
        if len(arr) < window:
            raise DataError(f"{name or corpus.source}: {what} data too small: {describe_bytes(len(arr))}, "
                            f"need at least {window} bytes (one window of seq_len+1)")
    description = (f"train {train_name}: {describe_bytes(len(train))}; "
                   f"eval {eval_name}: {describe_bytes(len(evaluation))}")
    return DataSplit(train, evaluation, protocol, description, train_name, eval_name, notes, books)
