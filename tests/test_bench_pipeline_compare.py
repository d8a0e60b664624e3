"""`bt-node bench pipeline-compare`: two `bench pipeline --record` files compared window by window."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from blocktrain.bench.pipeline_compare import compare, compare_pairs, load_record
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


def test_pairs_of_records_are_seeds_of_one_two_level_interval(tmp_path):
    """Three runs (seeds), each its chain against its own one-block reference: the figure is the mean
    over seeds and windows, its interval the two-level bootstrap of the (seeds, windows) differences."""
    rng = np.random.default_rng(1)
    chains, refs, files = [], [], []
    for seed, shift in enumerate((0.01, 0.05, -0.02)):
        ref = rng.normal(1.7, 0.3, 128)
        chain = ref + shift + rng.normal(0, 0.01, 128)
        chains.append(chain)
        refs.append(ref)
        files.append(write(tmp_path / f"s{seed}.json", record(list(chain), list(ref), seed=seed)))
    want = paired_bootstrap(np.stack(chains), np.stack(refs)).to_dict()
    args = [f for f in files for _ in (0, 1)]          # s0 s0 s1 s1 s2 s2
    res = compare_pairs([(load_record(a), load_record(b)) for a, b in zip(args[::2], args[1::2])],
                        b_arm="one_block")
    assert res["a_minus_b"] == want and want["n_seeds"] == 3
    assert [p["a"]["seed"] for p in res["pairs"]] == [0, 1, 2]
    assert want["per_seed"] == pytest.approx([0.01, 0.05, -0.02], abs=0.005)
    # a different seed mix gives a different (wider) interval than any one seed's
    one = compare(load_record(files[1]), load_record(files[1]), b_arm="one_block")["a_minus_b"]
    assert one["hi"] - one["lo"] < want["hi"] - want["lo"]
    out = CliRunner().invoke(cli, ["bench", "pipeline-compare", *args, "--b", "one_block"])
    assert out.exit_code == 0, out.output
    assert f"{want['mean']:+.4f} [{want['lo']:+.4f}, {want['hi']:+.4f}]" in out.output
    assert "x 3 pairs" in out.output and "two-level" in out.output


def test_an_odd_count_a_repeated_pair_or_a_pair_on_other_windows_is_refused(tmp_path):
    chain = [1.7] * 64
    a = write(tmp_path / "a.json", record(chain, chain))
    b = write(tmp_path / "b.json", record(chain, chain, seed=2))
    other = write(tmp_path / "o.json", record([1.7] * 32, [1.7] * 32))
    for args, code, message in (([a, b, a], 2, "in pairs"), ([a, b, a, b], 2, "given twice"),
                                ([a, b, other, other], 1, "pair 2")):
        out = CliRunner().invoke(cli, ["bench", "pipeline-compare", *args])
        assert out.exit_code == code and message in out.output and "Traceback" not in out.output, out.output
