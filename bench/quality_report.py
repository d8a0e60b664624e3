"""bench quality, protocol v2: pool the arm-seed results of a study into one table.

Per arm: train CE and held-out CE (mean over seeds and the seeds' range), measured FLOPs per round,
epochs, training seconds; and the paired per-window difference to each reference arm present
(``one-block``, ``whole``, ``one-block@streamed``) over the seeds both have, with its two-level
bootstrap 95% interval (``blocks.stats``).
"""
from __future__ import annotations

import numpy as np

from blocktrain.blocks.stats import paired_bootstrap

from .quality_v2 import REFERENCES, STREAMED, StudyError

REFERENCE_ARMS = tuple(REFERENCES) + (f"one-block{STREAMED}",)


def _by_arm(runs: list[dict]) -> dict[str, dict[int, dict]]:
    arms: dict[str, dict[int, dict]] = {}
    digests = {r["windows_digest"] for r in runs}
    if len(digests) > 1:
        raise StudyError(f"results scored on different held-out windows ({', '.join(sorted(digests))}): "
                         "they cannot be paired")
    for r in runs:
        arms.setdefault(r["arm"], {})[int(r["seed"])] = r
    return arms


def _range(values: list[float]) -> list[float]:
    return [float(min(values)), float(max(values))]


def summarize(runs: list[dict], *, n_boot: int = 4000, level: float = 0.95, order: list[str] = ()) -> dict:
    """One row per arm (``order`` first, then as first seen) and the paired differences to each reference."""
    arms = _by_arm(runs)
    arms = {a: arms[a] for a in [*[o for o in order if o in arms], *[a for a in arms if a not in order]]}
    rows = []
    for arm, by_seed in arms.items():
        seeds = sorted(by_seed)
        rs = [by_seed[s] for s in seeds]
        held = [r["heldout_ce"] for r in rs]
        train = [r["train_ce"] for r in rs if "train_ce" in r]
        row = {
            "arm": arm, "seeds": seeds, "lr": sorted({r["lr"] for r in rs}),
            "heldout_ce": float(np.mean(held)), "heldout_range": _range(held),
            "train_ce": float(np.mean(train)) if train else None, "train_range": _range(train) if train else None,
            "flops_per_round": rs[0]["flops_per_round"], "flops_per_round_streamed": rs[0]["flops_per_round_streamed"],
            "rounds": rs[0]["rounds"], "steps": rs[0]["steps"], "flops_total": float(np.mean([r["flops_total"] for r in rs])),
            "epochs": float(max(r["epochs"] for r in rs)), "train_seconds": float(np.mean([r["train_seconds"] for r in rs])),
            "train_cpu_seconds": float(np.mean([r.get("train_cpu_seconds", np.nan) for r in rs])),
            "ce_kind": rs[0]["ce_kind"], "extra": rs[0].get("extra", {}), "diffs": {},
        }
        for ref in REFERENCE_ARMS:
            if ref == arm or ref not in arms:
                continue
            common = [s for s in seeds if s in arms[ref]]
            if not common:
                continue
            a = np.array([by_seed[s]["heldout_per_window"] for s in common])
            b = np.array([arms[ref][s]["heldout_per_window"] for s in common])
            row["diffs"][ref] = {"seeds": common, **paired_bootstrap(a, b, n_boot=n_boot, level=level).to_dict()}
        rows.append(row)
    return {"rows": rows, "n_windows": len(runs[0]["heldout_per_window"]) if runs else 0}


def _ci(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (seeds {','.join(map(str, d['seeds']))})"


def markdown_table(summary: dict) -> str:
    """The table BENCHMARKS.md records (nats/byte; differences are arm minus reference)."""
    refs = [r for r in REFERENCE_ARMS if any(r == row["arm"] for row in summary["rows"])]
    head = ["arm", "lr", "seeds", "train CE", "held-out CE mean (seed range)"] + \
        [f"minus {r} [95% CI]" for r in refs] + ["FLOPs per arm", "FLOPs per round (streamed)", "epochs",
                                                          "train s wall (CPU)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["rows"]:
        lo, hi = row["heldout_range"]
        cells = [row["arm"], "/".join(f"{x:g}" for x in row["lr"]), str(len(row["seeds"])),
                 f"{row['train_ce']:.3f}" if row["train_ce"] is not None else "",
                 f"{row['heldout_ce']:.3f} ({lo:.3f}-{hi:.3f})"]
        cells += [_ci(row["diffs"][r]) if r in row["diffs"] else "" for r in refs]
        fpr, fps = row["flops_per_round"], row["flops_per_round_streamed"]
        cells += [f"{row['flops_total']:.3g}", f"{fpr:.3g}" + (f" ({fps:.3g})" if fps < fpr else ""),
                  f"{row['epochs']:.3f}",
                  f"{row['train_seconds']:.0f} ({row['train_cpu_seconds']:.0f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
