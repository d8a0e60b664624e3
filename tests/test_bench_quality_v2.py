"""bt-node bench quality, protocol v2, through the command line: the tiny preset runs the whole protocol
(LR sweep on a carved validation part, arms at equal measured FLOPs, two seeds, paired intervals),
a study folder is resumed and extended and never mixed, the h200 preset's plan fits its 8 minutes,
and bad input gets one clear line."""
from __future__ import annotations

import json
import math
import os

import pytest
from click.testing import CliRunner

from blocktrain.cli.main import cli

from test_utils.configs import TEST_CORPUS
from test_utils.zygote import run_cli


def bt(*args, timeout=600):
    return run_cli(["bench", "quality", *args], timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_json(*args):
    r = bt(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout), r.stderr


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    res, log = run_json("--data", str(TEST_CORPUS), "--preset", "tiny", "--out", str(out), "--json")
    return out, res, log


@pytest.mark.slow
def test_tiny_preset_runs_the_whole_protocol(tiny_study):
    out, res, _ = tiny_study
    assert res["protocol"] == "v2" and res["seeds"] == [0, 1]
    arms = ["paper", "forward-chained", "forward-streamed", "pipeline", "one-block", "whole", "one-block@streamed"]
    assert res["arms"] == arms
    # the learning rate of each arm kind is the grid point with the lowest validation CE
    sweep = res["lr_sweep"]
    assert sweep["grid"] == [1e-3, 2e-3, 4e-3] and "carved from train" in sweep["validation_protocol"]
    for kind in ("paper", "forward-chained", "forward-streamed", "pipeline", "one-block", "whole"):
        scores = sweep["scores"][kind]
        assert len(scores) == 3
        assert sweep["choice"][kind] == float(min(scores, key=scores.get))
        ranked = sorted(scores.values())
        assert sweep["margin"][kind] == pytest.approx(ranked[1] - ranked[0], abs=1e-6)
        # a sweep that could not tell the rates apart says so, on the result and on stderr
        source = "validation sweep" if sweep["margin"][kind] >= 0.02 else \
            f"validation sweep, undecided (margin {sweep['margin'][kind]:.3f})"
        assert res["lr"][kind] == {"lr": sweep["choice"][kind], "source": source}
        said = f"lr sweep: {kind}'s best rate beat the next by" in " ".join(tiny_study[2].split())   # rich wraps
        assert said == (sweep["margin"][kind] < 0.02)
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    assert len(runs) == 14 and len({r["windows_digest"] for r in runs}) == 1
    budget = float(res["settings"]["budget"].removesuffix("steps")) * runs_of(runs, "paper")[0]["flops_per_round"]
    for r in runs:
        assert len(r["heldout_per_window"]) == 48 and r["heldout_ce"] == pytest.approx(
            sum(r["heldout_per_window"]) / 48)
        assert 0 < r["train_ce"] < math.log(256) + 0.5 and r["epochs"] > 0
        # every arm trained to the same measured FLOPs (within half a round), @streamed to its share
        share = 1.0 if not r["arm"].endswith("@streamed") else ratio(runs)
        assert abs(r["flops_total"] - budget * share) <= 0.5 * r["flops_per_round"] + 1
    # the seeds differ in init and data order
    paper = runs_of(runs, "paper")
    assert paper[0]["heldout_per_window"] != paper[1]["heldout_per_window"]
    # the table: one row per arm, paired differences to each reference with intervals around their means
    rows = {row["arm"]: row for row in res["summary"]["rows"]}
    assert list(rows) == arms
    for arm, row in rows.items():
        assert row["seeds"] == [0, 1]
        lo, hi = row["heldout_range"]
        assert lo <= row["heldout_ce"] <= hi
        for ref, d in row["diffs"].items():
            assert ref != arm and d["lo"] <= d["mean"] <= d["hi"] and d["n_windows"] == 48 and d["n_seeds"] == 2
            assert d["mean"] == pytest.approx(row["heldout_ce"] - rows[ref]["heldout_ce"])   # same seeds
    assert set(rows["paper"]["diffs"]) == {"one-block", "whole", "one-block@streamed"}
    fc = rows["forward-chained"]
    assert fc["flops_per_round_streamed"] < fc["flops_per_round"]                     # upstream forwards
    assert rows["paper"]["flops_per_round_streamed"] == rows["paper"]["flops_per_round"]
    # chain-trained arms are charged what their workers run: forward-streamed's blocks receive their
    # inputs (forward-chained's round less its upstream forwards); pipeline's blocks make the whole model
    fs = rows["forward-streamed"]
    assert fs["flops_per_round"] == fs["flops_per_round_streamed"] == fc["flops_per_round_streamed"]
    assert rows["pipeline"]["flops_per_round"] == rows["whole"]["flops_per_round"]
    assert "| forward-chained |" in res["table"] and json.loads((out / "summary.json").read_text())["table"]


def runs_of(runs, arm):
    return sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])


def ratio(runs):
    fc = runs_of(runs, "forward-chained")[0]
    return fc["flops_per_round_streamed"] / fc["flops_per_round"]


@pytest.mark.slow
def test_a_study_folder_is_resumed_extended_and_never_mixed(tiny_study):
    out, first, _ = tiny_study
    again, log = run_json("--data", str(TEST_CORPUS), "--preset", "tiny", "--out", str(out), "--json")
    assert "reusing" in log and "training for" not in log
    assert again["summary"] == first["summary"]
    # one more seed for two arms: trained now and pooled with the stored seeds
    more, log = run_json("--data", str(TEST_CORPUS), "--preset", "tiny", "--out", str(out), "--json",
                         "--arms", "forward-chained,one-block", "--seeds", "2")
    assert log.count("training for") == 2
    rows = {row["arm"]: row for row in more["summary"]["rows"]}
    assert rows["forward-chained"]["seeds"] == [0, 1, 2] and rows["paper"]["seeds"] == [0, 1]
    assert rows["forward-chained"]["diffs"]["one-block"]["seeds"] == [0, 1, 2]
    assert rows["paper"]["diffs"]["one-block"]["seeds"] == [0, 1]
    # other settings in the same folder: refused, nothing written
    before = sorted(p.name for p in (out / "runs").iterdir())
    r = bt("--data", str(TEST_CORPUS), "--preset", "tiny", "--out", str(out), "--set", "d_model=16")
    assert r.returncode == 1 and "other settings" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in (out / "runs").iterdir()) == before


@pytest.mark.slow
def test_h200_preset_plan_fits_eight_minutes_and_needs_a_gpu_to_run():
    res, _ = run_json("--data", str(TEST_CORPUS), "--preset", "h200", "--plan", "--json")
    assert res["config"]["d_model"] == 512 and res["config"]["seq_len"] == 512
    # at the rates the 2026-12-04 H200 run measured, with a minute of the 8 to spare
    assert res["predicted"]["total_s"] <= 7 * 60
    assert res["total_flops"] == pytest.approx(res["main_flops"] + res["sweep_flops"])
    for row in res["arms"]:
        assert abs(row["flops"] - 5e15) <= row["flops_per_round"]
    # the estimate reproduces that run: 7e15 FLOPs per arm took more than its 500-s limit (summary unwritten)
    from blocktrain.bench.quality_presets import H200_MEASURED, predict_seconds
    rows = [{**r, "flops": round(7e15 / r["flops_per_round"]) * r["flops_per_round"]} for r in res["arms"]]
    old = predict_seconds(H200_MEASURED, {**res, "arms": rows}, sweep_fraction=0.125, n_rates=3, swept=True)
    assert 480 <= old["total_s"] <= 540
    r = bt("--data", str(TEST_CORPUS), "--preset", "h200", "--device", "cpu")
    assert r.returncode == 2 and "GPU" in r.stderr and "Traceback" not in r.stderr


def test_bad_input_is_one_clear_line():
    data = str(TEST_CORPUS)
    for args, code, words in (
        (["--arms", "paper,nope"], 1, "unknown arm"),
        (["--arms", "paper,paper"], 1, "twice"),
        (["--arms", "one-block@streamed", "--budget", "30s"], 1, "FLOP"),
        (["--lr", "paper=fast"], 2, "ARM=RATE"),
        (["--seeds", "0,x"], 2, "seeds"),
        (["--budget", "lots"], 1, "budget"),
        (["--upstream-every", "3"], 2, "v1"),
        (["--protocol", "v1", "--seeds", "0,1"], 2, "v2 only"),
    ):
        r = CliRunner().invoke(cli, ["bench", "quality", "--data", data, "--preset", "tiny", *args])
        assert r.exit_code == code, (args, r.output)
        assert words in r.output and "Traceback" not in r.output, (args, r.output)
    r = bt("--data", data, "--preset", "tiny", "--arms", "paper,nope")    # and the same from a real process
    assert r.returncode == 1 and "unknown arm" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sweep_margins_flag_rates_the_sweep_could_not_tell_apart():
    """The H200 run's 1/8-budget sweep (2026-12-04): whole scored 2.489 / 2.504 / 2.547 on validation (on the
    early plateau: its best rate won by 0.015, inside one seed's noise), one-block 1.669 / 1.615 / 2.513 (0.054)."""
    from blocktrain.bench.quality_v2 import SWEEP_MIN_MARGIN, sweep_margins

    m = sweep_margins({"whole": {"0.001": 2.489, "0.002": 2.504, "0.004": 2.547},
                       "one-block": {"0.001": 1.669, "0.002": 1.615, "0.004": 2.513}, "alone": {"0.002": 3.0}})
    assert m["whole"] == pytest.approx(0.015) and m["whole"] < SWEEP_MIN_MARGIN
    assert m["one-block"] == pytest.approx(0.054) and m["one-block"] >= SWEEP_MIN_MARGIN
    assert m["alone"] == math.inf


def test_a_stored_sweep_that_could_not_decide_is_reported(tiny_study, tmp_path):
    """Resuming a study whose stored sweep scored whole's rates within the margin: the result names the
    rate's source as undecided and stderr says so; the decided arms are unchanged."""
    import shutil

    out, res, _ = tiny_study
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    sweep = json.loads(json.dumps(res["lr_sweep"]))   # the study's own sweep (other tests extend the folder)
    chosen = f"{sweep['choice']['whole']:g}"
    sweep["scores"]["whole"] = {k: (2.489 if k == chosen else 2.5) for k in sweep["scores"]["whole"]}
    sweep.pop("margin")   # as a sweep stored before the field was
    (copy / "lr_sweep.json").write_text(json.dumps(sweep))
    res, log = run_json("--data", str(TEST_CORPUS), "--preset", "tiny", "--out", str(copy), "--no-lr-sweep", "--json")
    assert res["lr"]["whole"] == {"lr": sweep["choice"]["whole"], "source": "validation sweep, undecided (margin 0.011)"}
    assert res["lr"]["paper"]["source"] == "validation sweep"
    assert "lr sweep: whole's best rate beat the next by 0.011" in " ".join(log.split())
