"""Windows of bytes: deterministic random training windows and the fixed evaluation sets.

:class:`WindowSampler` draws training windows of ``seq_len + 1`` bytes (per-worker seed,
resumable); :func:`eval_windows` builds the fixed evaluation set of a split; :func:`text_windows`
cuts a short text to score into windows.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .data import DataError, FileBytes, describe_bytes, gather_windows

__all__ = ["WindowSampler", "eval_windows", "text_windows"]


def _as_bytes_array(data: Any, what: str) -> np.ndarray | FileBytes:
    if isinstance(data, FileBytes):
        return data   # read window by window, never held whole
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    arr = np.asarray(data)
    if arr.ndim != 1:
        raise DataError(f"{what}: expected a 1-D byte array, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise DataError(f"{what}: values outside 0..255")
        arr = arr.astype(np.uint8)
    return arr


class WindowSampler:
    """Deterministic random windows of ``seq_len + 1`` bytes (inputs + next-byte targets).

    The stream depends only on ``(seed, worker_id)`` and the number of windows drawn so far;
    ``state_dict`` / ``load_state_dict`` let a resumed run continue the very same stream.
    """

    def __init__(self, data: Any, seq_len: int, *, seed: int = 0, worker_id: int = 0) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if seed < 0 or worker_id < 0:
            raise DataError(f"seed and worker_id must be >= 0, got seed={seed}, worker_id={worker_id}")
        self.data = _as_bytes_array(data, "WindowSampler")
        self.seq_len = int(seq_len)
        self.window = self.seq_len + 1
        if len(self.data) < self.window:
            raise DataError(f"WindowSampler: data has {describe_bytes(len(self.data))}, "
                            f"need at least seq_len+1 = {self.window}")
        self.seed = int(seed)
        self.worker_id = int(worker_id)
        self._rng = np.random.default_rng([self.seed, self.worker_id])
        self.batches_drawn = 0
        self.windows_drawn = 0

    def next_starts(self, batch_size: int) -> np.ndarray:
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        starts = self._rng.integers(0, len(self.data) - self.window + 1, size=batch_size, dtype=np.int64)
        self.batches_drawn += 1
        self.windows_drawn += int(batch_size)
        return starts

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """A ``LongTensor`` of shape ``(batch_size, seq_len + 1)``."""
        starts = self.next_starts(batch_size)
        return torch.from_numpy(gather_windows(self.data, starts, self.window)).long()

    def state_dict(self) -> dict[str, Any]:
        return {
            "bit_generator": self._rng.bit_generator.state,
            "batches_drawn": self.batches_drawn,
            "windows_drawn": self.windows_drawn,
            "seed": self.seed,
            "worker_id": self.worker_id,
            "seq_len": self.seq_len,
            "n_bytes": int(len(self.data)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("seq_len", self.seq_len), ("n_bytes", len(self.data))):
            if key in state and int(state[key]) != int(mine):
                raise DataError(f"WindowSampler state is for {key}={state[key]}, this sampler has {mine}")
        bg = state["bit_generator"]
        if bg.get("bit_generator") != type(self._rng.bit_generator).__name__:
            raise DataError(f"WindowSampler state uses bit generator {bg.get('bit_generator')!r}, "
                            f"expected {type(self._rng.bit_generator).__name__}")
        self._rng.bit_generator.state = bg
        self.batches_drawn = int(state.get("batches_drawn", 0))
        self.windows_drawn = int(state.get("windows_drawn", 0))
        self.seed = int(state.get("seed", self.seed))
        self.worker_id = int(state.get("worker_id", self.worker_id))


def eval_windows(data: Any, seq_len: int, n_windows: int, seed: int = 0) -> torch.Tensor:
    """The fixed evaluation set: ``n`` evenly spaced, non-overlapping windows of
    ``seq_len + 1`` bytes, as a ``LongTensor (n, seq_len + 1)``.

    ``n = min(n_windows, len(data) // (seq_len + 1))``: when the data is too short for
    ``n_windows`` the result has fewer rows (check ``len(result)``). Windows sit on a grid
    of spacing ``len(data) // n``; ``seed=0`` starts it at byte 0, another seed shifts the
    whole grid by a deterministic offset that keeps every window inside the data.
    """
    arr = _as_bytes_array(data, "eval_windows")
    if seq_len < 1 or n_windows < 1:
        raise DataError(f"eval_windows: seq_len and n_windows must be >= 1, got {seq_len}, {n_windows}")
    window = seq_len + 1
    n = min(int(n_windows), len(arr) // window)
    if n < 1:
        raise DataError(f"eval_windows: evaluation data has {describe_bytes(len(arr))}, "
                        f"need at least one window of seq_len+1 = {window} bytes")
    spacing = len(arr) // n  # >= window
    offset = 0
    if seed != 0 and spacing > window:
        offset = int(np.random.default_rng([int(seed), 0x5EED]).integers(0, spacing - window + 1))
    starts = offset + spacing * np.arange(n, dtype=np.int64)
    return torch.from_numpy(gather_windows(arr, starts, window)).long()


def text_windows(text: bytes, seq_len: int, max_windows: int = 16) -> torch.Tensor:
    """Windows to score a text of at least 2 bytes: of ``seq_len + 1`` bytes, or the whole text
    when shorter, at most ``max_windows`` of them."""
    data = np.frombuffer(text, dtype=np.uint8)
    if len(data) < 2:
        raise ValueError("text must be at least 2 bytes")
    seq = min(seq_len, len(data) - 1)
    return eval_windows(data, seq, max(1, min(max_windows, (len(data) - 1) // seq)))
