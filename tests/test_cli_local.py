"""train-local / eval / bench quality: the CLI contract, and that training lowers held-out loss."""
from __future__ import annotations

import json
import math

import pytest
import torch

from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.budget import Budget, BudgetError
from blocktrain.blocks.local_run import LocalRun

from test_utils.configs import TEST_CORPUS, TEST_CORPUS_PROTOCOL, tiny_config
from test_utils.zygote import run_cli

TINY = ["--set", "d_model=32", "--set", "n_heads=2", "--set", "layers_per_block=1", "--set", "n_blocks=2",
        "--set", "seq_len=32", "--set", "target_dim=16", "--set", "batch_size=4"]


def bt(*args, timeout=300):
    return run_cli(list(args), timeout=timeout)


def test_budget_parsing():
    assert Budget.parse("500steps").steps == 500
    assert Budget.parse("90s").seconds == 90 and Budget.parse("2m").seconds == 120
    for bad in ("", "ten steps", "-3s", "1.5steps", "90 parsecs"):
        with pytest.raises(BudgetError):
            Budget.parse(bad)


def test_tiny_training_lowers_held_out_loss_on_real_text():
    data = TEST_CORPUS
    torch.manual_seed(0)
    run = LocalRun(tiny_config(n_blocks=2, lr=3e-3), resolve_data(str(data)), torch.device("cpu"))
    before = run.evaluate(n_windows=16, k=2)
    run.train(Budget(steps=60))
    after = run.evaluate(n_windows=16, k=2)
    assert before["protocol"] == TEST_CORPUS_PROTOCOL
    assert after["reference_ce"] < before["reference_ce"] - 0.5
    assert after["block0_ce"] < before["block0_ce"] - 0.5
    assert after["chain_ce"] < before["chain_ce"] - 0.5
    assert after["chain_ce"] < math.log(256)


def test_train_local_json_contract_and_eval_of_saved_checkpoint(tmp_path):
    data = TEST_CORPUS
    out = tmp_path / "ck"
    r = bt("train-local", "--data", str(data), "--budget", "5steps", "--out", str(out), "--json",
           "--eval-windows", "8", "--k", "2", *TINY)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for key in ("chain_ce", "chain_k", "chain_ce_k1", "block0_ce", "block_ce", "ce_kind", "protocol",
                "tokens", "seconds", "objective", "reference_ce"):
        assert key in res, key
    assert res["ce_kind"] == "exact" and res["protocol"] == TEST_CORPUS_PROTOCOL and res["objective"] == "paper"
    assert len(res["block_ce"]) == 2 and res["tokens"] == 5 * 4 * 32
    assert sorted(p.name for p in out.iterdir()) == ["block00.safetensors", "block01.safetensors",
                                                     "config.json", "reference.safetensors"]
    r2 = bt("eval", "--checkpoint", str(out), "--data", str(data), "--json", "--eval-windows", "8", "--k", "2")
    assert r2.returncode == 0, r2.stderr
    res2 = json.loads(r2.stdout)
    assert res2["chain_ce"] == pytest.approx(res["chain_ce"], abs=1e-4)
    assert res2["reference_ce"] == pytest.approx(res["reference_ce"], abs=1e-4)


def test_no_reference_trains_and_saves_only_the_blocks(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 300)
    out = tmp_path / "ck"
    r = bt("train-local", "--data", str(f), "--budget", "2steps", "--no-reference", "--out", str(out), "--json",
           "--eval-windows", "4", "--k", "1", *TINY)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert "reference_ce" not in res and "chain_ce" in res and res["protocol"] == "t.txt (last 5% held out)"
    assert "reference.safetensors" not in {p.name for p in out.iterdir()}


def test_bad_input_gives_one_clear_line_and_nonzero_exit(tmp_path):
    r = bt("train-local", "--data", str(tmp_path / "missing.txt"), "--budget", "1steps", *TINY)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "missing.txt" in r.stderr
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 200)
    r = bt("train-local", "--data", str(f), "--budget", "ten", *TINY)
    assert r.returncode == 1 and "budget" in r.stderr and "Traceback" not in r.stderr
    r = bt("train-local", "--data", str(f), "--set", "n_blocks=-2")
    assert r.returncode == 1 and "n_blocks" in r.stderr and "Traceback" not in r.stderr
    r = bt("train-local", "--data", str(f), "--objective", "nope")
    assert r.returncode == 1 and "unknown objective" in r.stderr
    r = bt("train-local", "--no-such-flag")
    assert r.returncode == 2 and "Usage" in r.stderr
    r = bt("eval", "--checkpoint", str(tmp_path), "--data", str(f))
    assert r.returncode == 1 and "Traceback" not in r.stderr and str(tmp_path) in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["paper", "forward-chained"])
def test_bench_quality_json_has_equal_flops_fields(objective):
    data = TEST_CORPUS
    r = bt("bench", "quality", "--protocol", "v1", "--data", str(data), "--budget", "3steps", "--json",
           "--eval-windows", "4", "--k", "2", *TINY, "--objective", objective)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for key in ("objective", "chain_ce", "ce_kind", "reference_ce", "single_block_reference_ce",
                "flops_each", "protocol"):
        assert key in res, key
    assert res["objective"] == objective
    f, steps = res["flops_each"], res["steps_each"]
    assert steps["block0"] == 3
    # each reference took as many steps as the chain's training FLOPs buy it: within one step
    for name, key in (("reference", "reference"), ("reference_1block", "single_block_reference")):
        per_step = f[key] / steps[name]
        assert abs(f[key] - f["chain"]) <= per_step * 1.0001, (name, f, steps)
    assert steps["reference_1block"] > steps["reference"]
