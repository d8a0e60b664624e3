"""``bt-node bench pipeline --tiny`` runs end to end on real node processes (one objective here, to
keep the test short: the preset trains 3 workers over 2 blocks for 10 s, then serves from their
checkpoints) and reports every figure the table and plot show."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from test_utils.configs import TEST_CORPUS

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_pipeline_tiny_reports_every_figure(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "blocktrain.cli.main", "bench", "pipeline", "--tiny", "--objective", "pipeline",
         "--data", str(TEST_CORPUS), "--workdir", str(tmp_path / "w"), "--json"],
        capture_output=True, text=True, timeout=540, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    r = res["runs"]["pipeline"]
    assert list(res["runs"]) == ["pipeline"] and res["settings"]["plan"] == [0, 1, 1]
    assert r["chain_ce"] < r["chain_ce_init"] - 0.5 and r["chain_ce_init"] == pytest.approx(math.log(256), abs=0.1)
    assert len(r["chain_ce_by_replica"]) == 2                       # block 1 is held twice
    assert r["tokens_per_s"] > 0 and r["microbatches_completed"] > 0 and r["microbatches_lost"] >= 0
    assert r["bytes_sent_total"] > 0 and r["bytes_sent_per_worker_per_step"] > 0
    assert r["peak_rss_mib_max"] > 50 and r["stalled_s_total"] >= 0
    assert all(w["pipeline_bytes_sent"] > 0 for w in r["workers"] if w["block"] == 0)
    sv = r["serving"]
    assert sv["mode"] == "autoregressive" and sv["bytes"] == 4 and sv["traversals"] == 4   # one traversal per byte
    assert sv["latency_s"] >= sv["injected_delay_floor_s"] == pytest.approx(4 * 2 * 2 * 0.005)
    assert (tmp_path / "w" / "pipeline" / "node0" / "ckpt").is_dir()
