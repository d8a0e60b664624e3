"""bench memory / bench throughput: the --tiny --json code paths, and structurally sane figures.

These assert only properties that follow from the shapes (a 2-layer block vs an 8-layer reference
at B=4), never the timing targets of issue 2: the machine running the suite may be busy.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from blocktrain.cli.main import cli
from blocktrain.bench.resources import peak_tflops_for


def bt_json(*args, timeout=120) -> dict:
    p = subprocess.run([sys.executable, "-m", "blocktrain.cli.main", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got {p.stdout!r}"
    return json.loads(lines[0])


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_memory_tiny_json():
    r = bt_json("bench", "memory", "--tiny", "--json")
    assert r["bench"] == "memory" and r["device"] in ("cpu", "cuda")
    assert r["config"]["n_blocks"] == 4 and r["config"]["layers_per_block"] == 2
    assert r["steps"] >= 1 and r["batch_size"] >= 1 and r["seq_len"] >= 2
    assert "fresh process" in r["method"] and "ru_maxrss" in r["method"]
    assert r["allocator"] == "node" and "tune_malloc" in r["method"]   # both processes: the node's settings
    b, ref = r["block"], r["reference"]
    assert (b["layers"], ref["layers"]) == (2, 8)
    assert b["params"] < ref["params"]
    for m in (b, ref):
        for k in ("baseline_rss_mib", "peak_rss_mib", "peak_increase_mib", "param_grad_adam_mib"):
            assert _pos(m[k]), (k, m[k])
        assert m["peak_rss_mib"] > m["peak_increase_mib"]  # the whole process holds torch as well
        assert m["peak_increase_mib"] >= m["param_grad_adam_mib"]  # weights, grads and AdamW state are live
        assert math.isfinite(m["loss_first"]) and math.isfinite(m["loss_last"])
    # 2 layers vs 8: the block's training footprint is structurally much smaller
    assert 0 < r["ratio_peak_increase"] < 0.8
    assert 0 < r["ratio_peak_rss"] < 1.0
    assert r["ratio"] == (r["ratio_cuda_max_allocated"] if r["device"] == "cuda" else r["ratio_live_tensors"])
    if r["device"] == "cpu":   # allocator events: weights and optimizer state before the step, activations in it
        for m in (b, ref):
            assert 0 < m["live_static_mib"] < m["live_peak_mib"] <= m["live_static_mib"] + m["live_step_peak_mib"] + 1e-9
        assert 0 < r["ratio_live_tensors"] < 0.8
    assert r["target_ratio"] == 0.35 and isinstance(r["meets_target"], bool)


def test_bench_throughput_tiny_json():
    r = bt_json("bench", "throughput", "--tiny", "--json")
    assert r["bench"] == "throughput" and r["iters"] >= 1
    b, ref = r["block"], r["reference"]
    assert (b["layers"], ref["layers"]) == (2, 8)
    for m in (b, ref):
        for k in ("flops_per_step", "step_s_median", "tokens_per_s", "achieved_tflops"):
            assert _pos(m[k]), (k, m[k])
        assert m["step_s_min"] <= m["step_s_median"] <= m["step_s_max"]
        assert m["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / m["step_s_median"])
    assert r["tokens_per_step"] == r["batch_size"] * r["seq_len"]
    assert r["flops_ratio"] > 2.0  # 8 layers vs 2 (+ the block's own extras)
    assert r["ratio"] > 1.0  # a 2-layer step is faster than an 8-layer one; no timing target asserted
    assert r["ratio"] == pytest.approx(b["tokens_per_s"] / ref["tokens_per_s"])
    assert _pos(r["ratio_paired_median"]) and _pos(r["ratio_best"])
    if r["device"] == "cpu":
        assert r["peak_tflops"] is None and b["mfu"] is None


def test_tiny_set_override_wins_and_bad_values_are_clean_errors():
    runner = CliRunner()
    res = runner.invoke(cli, ["bench", "throughput", "--tiny", "--set", "d_model=32", "--iters", "1",
                              "--warmup", "0", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["config"]["d_model"] == 32
    for args in (["bench", "memory", "--tiny", "--steps", "0"], ["bench", "memory", "--tiny", "--block", "9"],
                 ["bench", "throughput", "--tiny", "--iters", "0"], ["bench", "throughput", "--set", "nope=1"]):
        res = runner.invoke(cli, args)
        assert res.exit_code != 0 and "Traceback" not in res.output, (args, res.output)


def test_peak_table_is_an_assumption_by_name():
    assert peak_tflops_for("NVIDIA H200")[0] == 989.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe")[0] == 756.0
    tf, src = peak_tflops_for("Some Unknown GPU")
    assert tf is None and "--peak-tflops" in src


def test_bench_node_memory_reads_every_process_of_a_real_node_and_the_default_has_no_hivemind_child():
    from test_utils.configs import TEST_CORPUS
    r = bt_json("bench", "node-memory", "--layout", "before", "--layout", "after", "--settle", "2",
                "--samples", "2", "--interval", "0.5", "--data", str(TEST_CORPUS), "--json", timeout=600)
    before, after = r["runs"]

    def kinds(run):
        return {k for k, v in run["per_kind"].items() if v["processes"]}

    # hivemind's forked children (and torch's shm manager) where asked for; none by default
    assert kinds(before) == {"main", "dht", "averager", "p2pd", "torch_shm_manager"}, before["per_kind"]
    assert kinds(after) == {"main", "p2pd"}, after["per_kind"]
    assert r["block_tensors"]["tensor_bytes"] == 4 * r["block_tensors"]["param_bytes"] > 0
    for run in (before, after):
        assert all(v["pss_mb"] > 0 and v["rss_mb"] >= v["uss_mb"] for k, v in run["per_kind"].items()
                   if v["processes"])
        for m in ("rss", "pss"):
            lo, hi = run[f"total_{m}_mb_range"]
            assert lo <= run[f"total_{m}_mb"] <= hi
        assert 0 < run["total_uss_mb"] <= run["total_pss_mb"] <= run["total_rss_mb"]
        # RSS = its anonymous + file-backed parts (read a moment apart: a little slack)
        assert run["total_rss_anon_mb"] + run["total_rss_file_mb"] == pytest.approx(run["total_rss_mb"], abs=3)
        assert run["total_rss_file_mb"] > 10   # libtorch's code pages are file-backed
        # judged on the RSS sum, the figure other processes on the machine cannot lower
        assert run["overhead_mb"] == pytest.approx(run["total_rss_mb"] - run["tensors_mb"])
        assert run["overhead_pss_mb"] == pytest.approx(run["total_pss_mb"] - run["tensors_mb"])
        assert run["meets_target"] == (run["overhead_mb"] <= r["target_overhead_mb"])
    assert after["total_pss_mb"] < before["total_pss_mb"]   # two fewer python processes and no shm manager
    # the default unmaps start-up's library code pages (node/memory.py); "before" keeps them mapped
    assert after["per_kind"]["main"]["rss_file_mb"] < 0.75 * before["per_kind"]["main"]["rss_file_mb"], \
        (after["per_kind"]["main"], before["per_kind"]["main"])
    if os.geteuid() == 0:   # "alone" reads physical frame numbers, which only root sees
        # a page the node's own processes share counts once: the forked DHT and averager children share
        # most of the main process's pages (torch's among them), so "alone" is far below the RSS sum...
        assert before["total_alone_mb"] < before["total_rss_mb"] - 100, before
        assert before["total_alone_mb"] >= before["per_kind"]["main"]["rss_mb"] - 3
        # ...while the default's main process and p2pd share nothing: "alone" is the RSS sum
        assert after["total_alone_mb"] == pytest.approx(after["total_rss_mb"], abs=3)
    else:
        assert before["total_alone_mb"] is None


def test_a_pipeline_block_is_measured_with_its_stash():
    """bench memory on a pipeline block: the engine's step at K micro-batches in flight, whose graphs and
    weight copies (weight stashing) are live together, so the step's peak grows with K (in process, tiny)."""
    import torch
    from blocktrain.bench.resources import MiB, TINY_OVERRIDES, _Trainee, live_tensor_peak
    from blocktrain.blocks.config import ModelConfig
    cfg = ModelConfig(**{**TINY_OVERRIDES, "objective": "pipeline"})
    peaks = {}
    for k in (1, 4):
        tr = _Trainee("block", cfg, torch.device("cpu"), block_index=1, inflight=k)
        assert tr.describe()["inflight"] == k and tr.describe()["chain_training"] == "backprop"
        tr.step()
        peaks[k] = live_tensor_peak(tr)["live_step_peak_mib"]
    weights = sum(p.numel() * 4 for p in tr.module.parameters()) / MiB
    assert peaks[4] - peaks[1] >= 3 * weights, (peaks, weights)   # 3 more graphs and 3 more weight copies
    last = _Trainee("block", cfg, torch.device("cpu"), block_index=cfg.n_blocks - 1, inflight=4)
    assert math.isfinite(last.step()["loss"])                      # the last block computes the loss itself


def test_recompute_holds_inputs_not_graphs():
    """bench memory --recompute (the engine's --pipeline-recompute): at 4 micro-batches in flight a pipeline
    block that keeps only their inputs (each output goes to the wire), and runs each forward again before its backward,
    peaks within one graph of the 1-in-flight step, where keeping the graphs costs three more."""
    import torch
    from blocktrain.bench.resources import TINY_OVERRIDES, _Trainee, live_tensor_peak
    from blocktrain.blocks.config import ModelConfig
    cfg = ModelConfig(**{**TINY_OVERRIDES, "objective": "pipeline"})
    peak = {}
    for k, rc in ((1, False), (4, False), (4, True)):
        tr = _Trainee("block", cfg, torch.device("cpu"), block_index=1, inflight=k, recompute=rc, weight_stash=False)
        assert tr.describe()["recompute"] is rc and tr.describe()["weight_stash"] is False
        assert math.isfinite(tr.step()["grad_norm"])
        peak[k, rc] = live_tensor_peak(tr)["live_step_peak_mib"]
    graph = (peak[4, False] - peak[1, False]) / 3          # what one more kept graph costs
    assert graph > 0, peak
    assert peak[4, True] < peak[1, False] + graph, peak    # 4 held inputs cost less than one graph


def test_trainer_arena_pinned_mmap_threshold_shrinks_the_training_threads_arena():
    """bench/trainer_arena.py (issue 15): as the node runs, a tiny step's activations stay in the training
    thread's glibc arena; pinning the mmap threshold at 128 KiB returns them. Sizes only, never the CPU."""
    from test_utils.configs import TEST_CORPUS
    p = subprocess.run([sys.executable, "-m", "blocktrain.bench.trainer_arena", "--data",
                        str(TEST_CORPUS / "train.txt"), "--threshold", "none", "--threshold", "131072",
                        "--steps", "3", "--warmup", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    node, pinned = (json.loads(line) for line in p.stdout.strip().splitlines())
    assert node["threshold"] is None and pinned["threshold"] == 131072
    for r in (node, pinned):
        assert r["steps"] == 3 and r["cpu_ms_per_step"] > 0 and 0 <= r["arena_free_mb"] <= r["arena_mb"]
    assert pinned["arena_mb"] < node["arena_mb"] - 2, (node, pinned)
    bad = subprocess.run([sys.executable, "-m", "blocktrain.bench.trainer_arena", "--data", str(TEST_CORPUS / "train.txt"),
                          "--threshold", "lots"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--threshold takes" in bad.stderr


def test_bench_memory_timeout_stops_the_measurement_with_a_clear_error():
    """--timeout bounds each measurement's process (a model of hundreds of millions of parameters needs more
    than the default 900 s on a CPU): past it the child is killed and the command says which one; 0 is refused."""
    p = subprocess.run([sys.executable, "-m", "blocktrain.cli.main", "bench", "memory", "--tiny", "--timeout", "0.2",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "memory measurement of the block took more than 0.2 s" in p.stderr, p.stderr[-2000:]
    assert p.stdout == ""
    bad = subprocess.run([sys.executable, "-m", "blocktrain.cli.main", "bench", "memory", "--tiny", "--timeout", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--timeout" in bad.stderr


def test_layer_checkpoint_holds_one_layers_activations():
    """bench memory --layer-checkpoint (the engine's --pipeline-layer-checkpoint): a 3-layer pipeline block's
    step, 4 micro-batches in flight with recompute, keeps one layer's activations at a time, not three;
    the bench refuses the flag for a block-local objective (nothing it could measure)."""
    import torch
    from blocktrain.bench.resources import TINY_OVERRIDES, _Trainee, bench_memory, live_tensor_peak
    from blocktrain.blocks.config import ModelConfig
    from blocktrain.blocks.layers import layer_checkpointing
    cfg = ModelConfig(**{**TINY_OVERRIDES, "objective": "pipeline", "layers_per_block": 3})
    peak, static = {}, {}
    for ckpt in (False, True):
        tr = _Trainee("block", cfg, torch.device("cpu"), block_index=1, inflight=4, recompute=True, weight_stash=False)
        with layer_checkpointing(ckpt):
            assert math.isfinite(tr.step()["grad_norm"])
            live = live_tensor_peak(tr)
        peak[ckpt], static[ckpt] = live["live_step_peak_mib"], live["live_static_mib"]
    assert static[True] == static[False]                 # the same weights, gradients and AdamW state
    assert peak[True] < 0.6 * peak[False], peak          # one layer's graph (+ the layers' inputs), not three
    with pytest.raises(ValueError, match="chain-trained"):
        bench_memory(ModelConfig(**{**TINY_OVERRIDES, "objective": "paper"}), torch.device("cpu"), steps=1,
                     layer_checkpoint=True)
