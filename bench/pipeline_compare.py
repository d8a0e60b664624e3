"""Two ``bench pipeline --record`` results compared window by window (protocol v2's paired interval
across runs: e.g. the same command before and after an engine fix, on the same held-out windows).

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


def compare(a: dict, b: dict, *, a_arm: str = "chain", b_arm: str = "chain", objective: str = "pipeline",
            n_boot: int = 4000) -> dict:
    """Mean over the windows of A's arm minus B's arm, with a paired bootstrap 95% interval."""
    ka, kb = _windows_key(a), _windows_key(b)
    if ka != kb:
        diff = {k: (ka[k], kb[k]) for k in ka if ka[k] != kb[k]}
        raise ValueError(f"the records were not scored on the same held-out windows: {diff}")
    la, ca, pa = arm(a, a_arm, objective)
    lb, cb, pb = arm(b, b_arm, objective)
    if len(pa) != len(pb):
        raise ValueError(f"{len(pa)} windows against {len(pb)}: not the same windows")
    d = paired_bootstrap(pa, pb, n_boot=n_boot)
    return {"a": {"arm": la, "ce": ca, "date": a.get("date"), "seed": a.get("settings", {}).get("seed")},
            "b": {"arm": lb, "ce": cb, "date": b.get("date"), "seed": b.get("settings", {}).get("seed")},
            "windows": ka, "a_minus_b": d.to_dict()}
