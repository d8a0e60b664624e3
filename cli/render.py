"""Printing results: a rich table on stderr for people, one JSON object on stdout for tools."""
from __future__ import annotations

import json
import math
import os
import re
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _stderr_console() -> Console:
    """rich fits a table to a terminal's width; written to a file or a pipe (the log of a long benchmark, run with
    nohup) it would squeeze a wide table into 80 columns, a character or two per cell. There, unless COLUMNS says
    otherwise, tables keep their natural width (up to 400 columns)."""
    wide = not sys.stderr.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=True, width=400 if wide else None)


err_console = _stderr_console()


# C0 controls but tab and newline, DEL, C1: escape sequences that can move the cursor, clear the screen,
# retitle the window or (OSC 52) write the clipboard
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str, stream=None) -> str:
    """Text a model generated or a node sent, for printing: on a terminal, control characters are shown as
    ``\\xNN`` instead of acting (a byte-level model can emit ESC, and a hostile node anything); piped
    output is left as it is."""
    stream = stream if stream is not None else sys.stdout
    if not getattr(stream, "isatty", lambda: False)():
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def plain(value) -> str:
    """An untrusted value (a peer id, a state a node reported) inside rich markup: no markup of its own,
    no control characters."""
    return escape(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value)))


def emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=_default) + "\n")
    sys.stdout.flush()


def _default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}"
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    return str(v)


def eval_table(res: dict, title: str) -> Table:
    t = Table(title=title)
    t.add_column("model")
    t.add_column("held-out nats/byte", justify="right")
    t.add_column("note")
    kind = res.get("ce_kind", "exact")
    t.add_row(f"chain, K={res['chain_k']} average", fmt(res["chain_ce"]), f"{kind}; the composed model")
    t.add_row("chain, K=1", fmt(res["chain_ce_k1"]), "one sample of starting noise")
    for b, ce in enumerate(res["block_ce"]):
        t.add_row(f"block {b} alone", fmt(ce), "own noise level, uninformative input")
    if "reference_ce" in res:
        t.add_row("end-to-end reference", fmt(res["reference_ce"]), "same total depth, equal steps")
    if "single_block_reference_ce" in res:
        t.add_row("one-block-size reference", fmt(res["single_block_reference_ce"]), "equal training FLOPs")
    t.caption = f"protocol: {res.get('protocol')}; {res.get('eval_tokens')} held-out bytes"
    return t
