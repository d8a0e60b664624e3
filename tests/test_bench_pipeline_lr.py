"""``bt-node bench pipeline --lr-sweep`` (protocol v2): each arm's learning rate is chosen on books carved
from the training bytes, then the bench runs at the chosen rates; every chain and reference also reports
its CE on windows of the training bytes. One real tiny sweep (2 rates, real node processes), the choice
rule, and bad flags refused before any training."""
from __future__ import annotations

import json
import math

import pytest

from blocktrain.bench.pipeline_lr import arm_ce, choose
from test_utils.configs import TEST_CORPUS
from test_utils.zygote import run_cli

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.timeout(600)]


def _run(args, timeout=540):
    return run_cli(["bench", "pipeline", *args], timeout=timeout,
                   env={"OMP_NUM_THREADS": "1", **__import__("os").environ, "COLUMNS": "1000"})   # no wrapping


def test_lr_sweep_chooses_each_arm_on_carved_books_then_runs_at_those_rates(tmp_path):
    out = _run(["--tiny", "--objective", "pipeline", "--layout", "0,1", "--no-serving", "--no-wall-reference",
                "--no-whole-reference", "--train-seconds", "5", "--lr-sweep", "--lr-grid", "3e-4,1e-2",
                "--sweep-windows", "16", "--train-windows", "16", "--data", str(TEST_CORPUS),
                "--workdir", str(tmp_path / "w"), "--json"])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    sw = res["lr_sweep"]
    assert sw["grid"] == [3e-4, 1e-2] and sw["fixed"] == {}
    table = {float(lr): row for lr, row in sw["validation_ce"].items()}
    assert set(table) == {3e-4, 1e-2} and all(set(row) == {"pipeline", "one_block"} for row in table.values())
    assert all(0 < ce < math.log(256) + 0.5 for row in table.values() for ce in row.values())
    # each arm took the rate with its lowest validation CE, and the final run trained each arm at it
    assert sw["chosen"] == {a: min(table, key=lambda lr: table[lr][a]) for a in ("pipeline", "one_block")}
    assert res["lr_by_arm"] == sw["chosen"] and res["runs"]["pipeline"]["config"]["lr"] == sw["chosen"]["pipeline"]
    # the validation part is the tail of the training bytes (never the test split), the rest trained on
    train = (TEST_CORPUS / "train.txt").read_bytes()
    assert sw["trained_on_bytes"] + sw["validation_bytes"] == len(train)
    assert sw["validation_bytes"] >= 0.025 * len(train) - 1 and "carved from train" in sw["validation"]
    # the final run is scored on the test windows as always, with train CE beside held-out CE
    r, fair = res["runs"]["pipeline"], res["references"]["one_block_cpu"]
    assert res["settings"]["eval_windows"] == 8 and len(r["chain_ce_per_window"]) == 8 and res["train_windows"] == 16
    assert 0 < r["chain_ce_train"] < math.log(256) and 0 < fair["ce_train"] < math.log(256)
    # the table says each arm's rate and train CE, and where the rates were chosen
    from rich.console import Console

    from blocktrain.cli.bench_pipeline_cmd import pipeline_table
    console = Console(width=400, record=True)
    console.print(pipeline_table(res))
    text = console.export_text()
    assert "train CE" in text and f"{r['chain_ce_train']:.4f}" in text and f"{fair['ce_train']:.4f}" in text
    assert f"lr per arm chosen on {sw['validation']}" in text, text


def test_cosine_schedule_decays_every_arm_over_its_own_budget(tmp_path):
    out = _run(["--tiny", "--objective", "pipeline", "--layout", "0,1", "--no-serving", "--no-whole-reference",
                "--train-seconds", "6", "--lr-schedule", "cosine", "--train-windows", "0", "--data", str(TEST_CORPUS),
                "--workdir", str(tmp_path / "w"), "--record", str(tmp_path / "rec.json")])   # progress and table shown
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "rec.json").read_text().splitlines()[-1])
    peak = res["runs"]["pipeline"]["config"]["lr"]
    assert res["settings"]["lr_schedule"] == "cosine" and res["train_windows"] == 0
    # every worker decayed over the bench's wall time from its first step: well below the peak by the end
    workers = res["runs"]["pipeline"]["workers"]
    assert all(w["lr_last"] is not None and 0.1 * peak - 1e-12 <= w["lr_last"] < 0.6 * peak for w in workers), workers
    # the one-block reference: one process per budget (wall, CPU), each at a tenth of the peak by its end;
    # each stopped at its own budget (how many steps each made depends on the machine's load: not asserted)
    one, fair = res["references"]["one_block"], res["references"]["one_block_cpu"]
    assert one["train_wall_s"] >= 6 and one["steps"] > 0
    assert fair["steps"] > 0 and fair["cpu_budget_s"] == fair["worker_cpu_s"]["mean"] > 0
    assert fair["cpu_s"] >= round(fair["cpu_budget_s"], 2) - 0.01
    # the progress line reads each from its own process
    assert f"{one['ce']:.4f} after {one['train_wall_s']:.0f}s of wall time ({one['steps']} steps" in out.stderr
    assert f"one-block CE {fair['ce']:.4f} at {fair['cpu_s']:.0f} CPU-s ({fair['steps']} steps" in out.stderr
    for ref in (one, fair):
        assert ref["lr_schedule"] == "cosine" and 0.1 * peak - 1e-12 <= ref["lr_last"] < 0.15 * peak, ref


def test_choice_rule_and_arm_readings():
    table = {1e-3: {"pipeline": 2.0, "one_block": 1.9}, 2e-3: {"pipeline": 1.8, "one_block": 1.9},
             4e-3: {"pipeline": 1.85, "one_block": 2.1}}
    assert choose(table) == {"pipeline": 2e-3, "one_block": 1e-3}   # a tie goes to the smaller rate
    res = {"runs": {"pipeline": {"chain_ce": 1.7}},
           "references": {"whole": {"ce": 1.6}, "one_block": {"ce": 1.75}, "one_block_cpu": {"ce": 1.8}}}
    assert [arm_ce(res, a) for a in ("pipeline", "whole", "one_block")] == [1.7, 1.6, 1.75]
    del res["references"]["one_block"]          # --no-wall-reference: the CPU-budget reading is the headline
    assert arm_ce(res, "one_block") == 1.8


@pytest.mark.parametrize("args, message", [
    (["--lr-sweep", "--lr-grid", "1e-3"], "two or more distinct positive rates"),
    (["--lr-sweep", "--lr-grid", "1e-3,x"], "two or more distinct positive rates"),
    (["--lr", "pipeline=-1"], "positive rate"),
    (["--lr", "pipeline"], "positive rate"),
    (["--lr", "nonsense=1e-3"], "arms are pipeline, one_block"),
    (["--lr-sweep", "--lr", "pipeline=1e-3", "--lr", "one_block=1e-3"], "nothing to sweep"),
], ids=["grid-one", "grid-word", "lr-negative", "lr-no-rate", "lr-unknown-arm", "all-fixed"])
def test_bad_lr_flags_are_refused_before_training(tmp_path, args, message):
    from click.testing import CliRunner

    from blocktrain.cli.main import cli
    out = CliRunner().invoke(cli, ["bench", "pipeline", "--tiny", "--objective", "pipeline", "--layout", "0,1",
                                   "--no-whole-reference", "--data", str(TEST_CORPUS), "--workdir",
                                   str(tmp_path / "w"), *args])
    assert out.exit_code in (1, 2) and message in out.output, out.output
    assert not (tmp_path / "w").exists()   # no network was started
