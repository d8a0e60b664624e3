"""Paired comparisons of two models scored on the same held-out windows, over one or more seeds.

Every arm of ``bench quality`` is scored on the SAME fixed windows, so the difference between two
arms is measured window by window: ``d[s, w] = ce_a[s, w] - ce_b[s, w]`` for seed ``s`` and window
``w``. The figure is the mean of ``d``; its 95% interval comes from a bootstrap that resamples
windows and, with more than one seed, seeds too (a two-level bootstrap: each replicate draws S
seeds and W windows with replacement, the same windows for every seed drawn, since the windows are
shared). So the interval carries both the sampling of text and the spread between training runs.
With few seeds it is still narrower than the truth (resampling S seeds understates their variance
by a factor (S - 1) / S), which is why the per-seed means are reported beside it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class PairedDiff:
    mean: float              # mean over seeds and windows of a - b
    lo: float                # bootstrap interval (level)
    hi: float
    level: float
    per_seed: tuple[float, ...]   # mean of a - b in each seed
    n_windows: int
    n_seeds: int
    n_boot: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_seed"] = list(self.per_seed)
        return d

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0


def _as_seeds_by_windows(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] < 2:
        raise ValueError(f"{name}: expected per-window values, shape (windows,) or (seeds, windows) "
                         f"with at least 2 windows, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: per-window values must be finite")
    return a


def paired_bootstrap(a, b, *, n_boot: int = 4000, level: float = 0.95, seed: int = 0,
                     chunk: int = 500) -> PairedDiff:
    """Mean of ``a - b`` over (seeds, windows) and its two-level bootstrap percentile interval.

    ``a`` and ``b``: per-window values, shape (windows,) for one seed or (seeds, windows), row s of
    ``a`` paired with row s of ``b`` and column w with column w (the same window)."""
    a, b = _as_seeds_by_windows(a, "a"), _as_seeds_by_windows(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired arms must have the same shape (seeds, windows): {a.shape} vs {b.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if n_boot < 100:
        raise ValueError(f"n_boot must be >= 100, got {n_boot!r}")
    d = a - b
    n_seeds, n_windows = d.shape
    rng = np.random.default_rng(seed)
    reps = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        m = min(chunk, n_boot - start)
        win = rng.multinomial(n_windows, np.full(n_windows, 1.0 / n_windows), size=m) / n_windows  # (m, W)
        per_seed = win @ d.T                                                                     # (m, S)
        if n_seeds > 1:
            sw = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=m) / n_seeds    # (m, S)
            reps[start:start + m] = (per_seed * sw).sum(axis=1)
        else:
            reps[start:start + m] = per_seed[:, 0]
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(reps, [tail, 1.0 - tail])
    return PairedDiff(mean=float(d.mean()), lo=float(lo), hi=float(hi), level=level,
                      per_seed=tuple(float(x) for x in d.mean(axis=1)), n_windows=n_windows,
                      n_seeds=n_seeds, n_boot=n_boot)
