"""``bt-node bench pipeline-wall-reference``: a ``--no-wall-reference`` record gets its one-block reference
after the same wall time, trained afterwards in its own process with the record's settings (the same function
the bench calls), compared window by window with the recorded chain; the source record is only read, and bad
records and flags are refused with one line and nothing written. ``train_reference`` waits as long as its
child trains (a fixed 3,600 s cut off an 80-minute reference), or a given timeout, after which the child is
gone."""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import time
from dataclasses import asdict

import pytest

from test_utils.configs import TEST_CORPUS
from test_utils.zygote import run_cli

pytestmark = [pytest.mark.timeout(300)]


def _record(tmp_path, **settings):
    """A record as ``bench pipeline --tiny --no-wall-reference --record`` writes it (the chain's per-window CE
    stands in for a network's: this test is about the reference)."""
    from blocktrain.bench.pipeline import PipelineBenchSettings
    from blocktrain.blocks.data import resolve_data
    s = PipelineBenchSettings.tiny()
    s.wall_reference, s.whole_reference, s.data = False, False, str(TEST_CORPUS)
    s.train_s, s.lr_schedule, s.lrs = 3.0, "cosine", {"one_block": 4e-3}
    for k, v in settings.items():
        setattr(s, k, v)
    chain = [5.0 + 0.01 * i for i in range(s.eval_windows)]
    rec = {"date": "2026-12-01T00:00:00+00:00", "bench": "pipeline", "data": str(TEST_CORPUS),
           "protocol": resolve_data(str(TEST_CORPUS), seq_len=32).protocol, "config": {"seq_len": 32},
           "lr_by_arm": {"pipeline": 0.002, "one_block": 4e-3}, "train_windows": 4, "settings": asdict(s),
           "runs": {"pipeline": {"chain_ce": sum(chain) / len(chain), "chain_ce_per_window": chain}},
           "references": {"one_block_cpu": {"ce": 4.0, "per_window": [4.0] * len(chain)}}}
    p = tmp_path / "run.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    return p, rec, chain


def _cli(*args):
    return run_cli(["bench", "pipeline-wall-reference", *map(str, args)], timeout=240,
                   env={"OMP_NUM_THREADS": "1", **os.environ})


@pytest.mark.slow
def test_a_record_gets_its_wall_time_reference_and_the_source_is_only_read(tmp_path):
    src, rec, chain = _record(tmp_path)
    before = src.read_bytes()
    out = tmp_path / "done.jsonl"
    p = _cli(src, "--record", out, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    assert src.read_bytes() == before                                   # only read
    done = json.loads(out.read_text().splitlines()[-1])
    assert done == json.loads(p.stdout) and done["date"] == rec["date"]   # the run's date stays the record's
    one = done["references"]["one_block"]
    assert 3.0 <= one["train_wall_s"] < 6 and one["steps"] > 0 and one["n_layers"] == 1
    assert one["lr_schedule"] == "cosine" and one["lr_last"] == pytest.approx(4e-4, rel=0.05)   # decayed over 3 s
    assert one["ce"] < math.log(256) and len(one["per_window"]) == len(chain) and "ce_train" in one
    d = one["chain_minus"]
    assert d["chain"] == "pipeline" and d["n_windows"] == len(chain)
    assert d["mean"] == pytest.approx(sum(chain) / len(chain) - sum(one["per_window"]) / len(chain))
    assert one["trained_apart"]["chain_recorded"] == rec["date"] and done["settings"]["wall_reference"] is True
    assert done["references"]["one_block_cpu"] == rec["references"]["one_block_cpu"]   # the rest as it was
    # pipeline-compare reads it as any record with the reference
    c = run_cli(["bench", "pipeline-compare", str(out), str(out), "--b", "one_block", "--json"], timeout=120)
    assert c.returncode == 0, c.stderr[-2000:]
    assert json.loads(c.stdout)["a_minus_b"]["mean"] == pytest.approx(d["mean"], abs=1e-6)
    # a second time: the record has it already; refused, nothing appended
    again = _cli(out, "--record", tmp_path / "again.jsonl")
    assert again.returncode != 0 and "already has" in again.stderr and not (tmp_path / "again.jsonl").exists()


def test_bad_records_and_flags_are_refused_and_nothing_is_written(tmp_path):
    src, rec, _ = _record(tmp_path)
    cases = {
        "same file": (src, ["--record", src], "SOURCE is only read"),
        "no record": (tmp_path / "bad.jsonl", ["--record", tmp_path / "o1.jsonl"], "not a bench pipeline record"),
        "no per-window CE": (tmp_path / "nopw.jsonl", ["--record", tmp_path / "o2.jsonl"], "no CE for each"),
        "data moved": (tmp_path / "gone.jsonl", ["--record", tmp_path / "o3.jsonl"], "gone"),
    }
    (tmp_path / "bad.jsonl").write_text(json.dumps({"bench": "swarm"}) + "\n")
    nopw = json.loads(json.dumps(rec))
    del nopw["runs"]["pipeline"]["chain_ce_per_window"]
    (tmp_path / "nopw.jsonl").write_text(json.dumps(nopw) + "\n")
    gone = json.loads(json.dumps(rec))
    gone["data"] = gone["settings"]["data"] = str(tmp_path / "gone" / "train.txt")
    (tmp_path / "gone.jsonl").write_text(json.dumps(gone) + "\n")
    before = src.read_bytes()
    for name, (path, flags, says) in cases.items():
        p = _cli(path, *flags)
        assert p.returncode != 0 and says in p.stderr, (name, p.stderr[-2000:])
        assert "Traceback" not in p.stderr, (name, p.stderr[-2000:])
    assert src.read_bytes() == before and not list(tmp_path.glob("o*.jsonl"))


def test_a_reference_past_its_timeout_raises_and_its_process_is_gone():
    import torch

    from blocktrain.bench.pipeline_refs import train_reference
    from blocktrain.blocks.config import ModelConfig
    from blocktrain.node.swarm.run import typed_settings
    from blocktrain.bench.pipeline import TINY_CONFIG
    cfg = ModelConfig.from_dict(typed_settings(list(TINY_CONFIG)), source="test")
    before = {c.pid for c in mp.active_children()}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still training"):
        train_reference(cfg.to_dict(), str(TEST_CORPUS), 1, torch.zeros(2, cfg.seq_len + 1, dtype=torch.long),
                        seconds=600, timeout=4)
    assert time.monotonic() - t0 < 25   # stopped at once, not left its 30 s to finish
    assert not [c for c in mp.active_children() if c.pid not in before]
