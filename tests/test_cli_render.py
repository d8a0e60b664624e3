"""Tables printed to a file or a pipe (a benchmark's log) keep their natural width; COLUMNS still rules
(``cli/render.py``)."""
import os
import subprocess
import sys

HEADERS = [f"column-{i}-" + "x" * 22 for i in range(8)]   # 8 x 31 characters: far wider than 80 columns
SCRIPT = ("from rich.table import Table\n"
          "from blocktrain.cli.render import err_console\n"
          "t = Table()\n"
          f"for h in {HEADERS!r}:\n"
          "    t.add_column(h)\n"
          f"t.add_row(*{['1.4527'] * 8!r})\n"
          "err_console.print(t)\n")


def _stderr(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                       env={**base, **env}, text=True, timeout=60, check=True)
    return p.stderr


def test_piped_table_keeps_its_width():
    out = _stderr()
    for h in HEADERS:
        assert h in out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) > 8 * 31


def test_columns_still_rules():
    out = _stderr(COLUMNS="80")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert not all(h in out for h in HEADERS)   # squeezed, as asked
