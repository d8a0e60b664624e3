"""``bench pipeline --record`` results compared window by window (protocol v2's paired interval
across runs: e.g. the same command before and after an engine fix, on the same held-out windows).

One pair of records (A, B) is one seed; several pairs (e.g. the chain of each seed's run against the
one-block reference of the same run) give the mean over seeds and windows with a two-level bootstrap
interval (``blocks.stats.paired_bootstrap``: seeds and windows resampled), and each seed's mean.

A record holds each chain's CE per held-out window (``runs.<objective>.chain_ce_per_window``) and each
reference's (``references.<name>.per_window``). The windows are a function of the data, the window
length and their count only (``blocks.windows.eval_windows``), so two records that agree on those
scored the very same windows and can be paired; records that do not are refused, not compared.
"""
from __future__ import annotations

import json
from pathlib import Path

from blocktrain.blocks.stats import paired_bootstrap

def load_record(path: str | Path) -> dict:
    """The last JSON line of a ``--record`` file (the file is appended to, one line per run)."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty: no bench pipeline record in it")
    try:
        rec = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: the last line is not JSON ({e})") from None
    if not isinstance(rec, dict) or rec.get("bench") != "pipeline" or "runs" not in rec:
        raise ValueError(f"{path}: not a bench pipeline record (no 'bench': 'pipeline' and 'runs')")
    return rec


def _windows_key(rec: dict) -> dict:
    s, cfg = rec.get("settings", {}), rec.get("config", {})
    return {"protocol": rec.get("protocol"), "data": s.get("data"), "eval_windows": s.get("eval_windows"),
            "seq_len": cfg.get("seq_len")}


def arm(rec: dict, name: str, objective: str) -> tuple[str, float, list[float]]:
    """(label, CE, per-window CEs) of one arm of a record: its chain of ``objective`` or a reference."""
    if name == "chain":
        run = rec["runs"].get(objective)
        if run is None:
            raise ValueError(f"the record has no {objective!r} run (it has: {', '.join(rec['runs'])})")
        per = run.get("chain_ce_per_window")
        ce, label = run.get("chain_ce"), f"{objective} chain"
    else:
        ref = (rec.get("references") or {}).get(name)
        if ref is None:
            raise ValueError(f"the record has no {name!r} reference (it has: "
                             f"{', '.join(rec.get('references') or {}) or 'none'})")
        per, ce, label = ref.get("per_window"), ref.get("ce"), name
    if not isinstance(per, list) or len(per) < 2:
        raise ValueError(f"the record's {label} has no per-window CEs (recorded before they were kept)")
    return label, float(ce), [float(x) for x in per]


def compare(a: dict, b: dict, **kw) -> dict:
    """Mean over the windows of A's arm minus B's arm, with a paired bootstrap 95% interval (one seed)."""
    return compare_pairs([(a, b)], **kw)


def compare_pairs(pairs: list[tuple[dict, dict]], *, a_arm: str = "chain", b_arm: str = "chain",
                  objective: str = "pipeline", n_boot: int = 4000) -> dict:
    """Mean of A's arm minus B's arm over every pair (one seed each) and window, with a two-level
    bootstrap 95% interval; every record must have been scored on the same held-out windows."""
    if not pairs:
        raise ValueError("no records to compare")
    key = _windows_key(pairs[0][0])
    rows_a, rows_b, out = [], [], []
    for i, (a, b) in enumerate(pairs):
        for which, rec in (("A", a), ("B", b)):
            k = _windows_key(rec)
            if k != key:
                diff = {f: (key[f], k[f]) for f in key if key[f] != k[f]}
                where = f" (pair {i + 1}, {which})" if len(pairs) > 1 else ""
                raise ValueError(f"the records were not scored on the same held-out windows{where}: {diff}")
        la, ca, pa = arm(a, a_arm, objective)
        lb, cb, pb = arm(b, b_arm, objective)
        counts = {len(pa), len(pb), *(len(r) for r in rows_a[:1])}
        if len(counts) > 1:
            raise ValueError(f"per-window CEs of {sorted(counts)} windows: not the same windows")
        rows_a.append(pa)
        rows_b.append(pb)
        out.append({"a": {"arm": la, "ce": ca, "date": a.get("date"), "seed": a.get("settings", {}).get("seed")},
                    "b": {"arm": lb, "ce": cb, "date": b.get("date"), "seed": b.get("settings", {}).get("seed")}})
    d = paired_bootstrap(rows_a, rows_b, n_boot=n_boot)
    return {"pairs": out, "windows": key, "a_minus_b": d.to_dict()}
