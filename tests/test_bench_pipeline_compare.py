"""`bt-node bench pipeline-compare`: two `bench pipeline --record` files compared window by window."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from blocktrain.bench.pipeline_compare import compare, load_record
from blocktrain.blocks.stats import paired_bootstrap
from blocktrain.cli.main import cli


def record(chain, one_block=None, *, windows=None, seed=1, seq_len=288) -> dict:
    n = len(chain) if windows is None else windows
    rec = {"date": "2026-12-01T00:00:00+00:00", "bench": "pipeline", "protocol": "gutenberg-offline",
           "settings": {"data": "/d/gutenberg", "eval_windows": n, "seed": seed}, "config": {"seq_len": seq_len},
           "runs": {"pipeline": {"chain_ce": float(np.mean(chain)), "chain_ce_per_window": list(chain)}},
           "references": {}}
    if one_block is not None:
        rec["references"]["one_block"] = {"ce": float(np.mean(one_block)), "per_window": list(one_block)}
    return rec


def write(path, *recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_the_mean_and_interval_are_those_of_the_paired_windows(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.normal(1.7, 0.3, 256)
    a, b = base - 0.02 + rng.normal(0, 0.01, 256), base   # A better by 0.02 on every window, give or take
    old = record(list(b + 5.0))                           # an older line of the same file: not used
    pa, pb = write(tmp_path / "a.json", old, record(list(a))), write(tmp_path / "b.json", record(list(b), list(a)))
    res = compare(load_record(pa), load_record(pb))
    want = paired_bootstrap(a, b).to_dict()
    assert res["a_minus_b"] == want and res["a_minus_b"]["hi"] < 0 and res["a_minus_b"]["n_windows"] == 256
    assert res["a_minus_b"]["mean"] == pytest.approx(float(np.mean(a - b)))
    # A's chain against B's one-block reference (here equal to A's chain): zero, exactly
    same = compare(load_record(pa), load_record(pb), b_arm="one_block")["a_minus_b"]
    assert same["mean"] == 0.0 and same["lo"] == 0.0 == same["hi"]
    out = CliRunner().invoke(cli, ["bench", "pipeline-compare", pa, pb])
    assert out.exit_code == 0 and f"{want['mean']:+.4f} [{want['lo']:+.4f}, {want['hi']:+.4f}]" in out.output


@pytest.mark.parametrize("b_kwargs,b_arm,message", [
    (dict(seq_len=128), "chain", "not scored on the same held-out windows"),
    (dict(windows=512), "chain", "not scored on the same held-out windows"),
    (dict(), "whole", "no 'whole' reference"),
])
def test_records_that_cannot_be_paired_are_refused_with_a_clear_error(tmp_path, b_kwargs, b_arm, message):
    chain = [1.7] * 64
    pa = write(tmp_path / "a.json", record(chain))
    pb = write(tmp_path / "b.json", record(chain, **b_kwargs))
    out = CliRunner().invoke(cli, ["bench", "pipeline-compare", pa, pb, "--b", b_arm])
    assert out.exit_code == 1 and message in out.output and "Traceback" not in out.output, out.output


def test_a_file_that_is_not_a_record_is_refused(tmp_path):
    for text in ("", "not json\n", json.dumps({"bench": "swarm"}) + "\n"):
        p = tmp_path / "x.json"
        p.write_text(text)
        out = CliRunner().invoke(cli, ["bench", "pipeline-compare", str(p), str(p)])
        assert out.exit_code == 1 and str(p) in out.output and "Traceback" not in out.output, out.output
