"""Protocol v2's parts: measured FLOPs, the cosine schedule, the validation carve, the paired bootstrap."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.blocks.budget import Budget, BudgetError
from blocktrain.blocks.chain_train import chain_gradients, stage_step_flops
from blocktrain.blocks.data import DataError, DataSplit, carve_validation, resolve_data
from blocktrain.blocks.flops import measure_step_flops, measured_flops
from blocktrain.blocks.local_run import LocalRun
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.reference import ReferenceLM
from blocktrain.blocks.stats import paired_bootstrap
from blocktrain.blocks.train import LrSchedule, lr_at, reference_loss_fn

from test_utils import flop_formulas
from test_utils.configs import TEST_CORPUS, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def windows(n, t, seed=0):
    return torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(seed))


# -- measured FLOPs -----------------------------------------------------------------------------------------
def test_reference_step_is_counted_exactly_attention_included():
    cfg = tiny_config()
    n, t, d = 4, cfg.seq_len, cfg.d_model
    for layers in (1, 3):
        model = ReferenceLM(cfg, n_layers=layers)
        got = measure_step_flops(model, reference_loss_fn(model, windows(n, t)))
        assert got == flop_formulas.ar_train_step(n, t, d, layers)
        assert all(p.grad is None for p in model.parameters())   # counting leaves no gradient behind


def test_upstream_forwards_are_charged_without_the_head_they_do_not_run():
    cfg = tiny_config(objective="forward-chained", n_blocks=3)
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(3)]
    n, t, d = 4, cfg.seq_len, cfg.d_model
    w = windows(n, t)
    steps = [measure_step_flops(m, lambda m=m, b=b: obj.local_loss(m, b, w, upstream=blocks[:b]))
             for b, m in enumerate(blocks)]
    upstream = flop_formulas.stream_forward(n, t, d, cfg.layers_per_block)
    assert steps[0] == flop_formulas.ar_train_step(n, t, d, cfg.layers_per_block)
    assert steps[2] - steps[0] == 2 * upstream            # two upstream blocks' layers, no head
    assert measured_flops(lambda: obj.upstream_state(blocks[:2], w[:, :-1])) == 2 * upstream


def test_a_buffer_used_as_a_weight_is_counted():
    """The paper block reads logits off the fixed target table (a buffer). Growing target_dim by 16
    adds the head (6 n t d per dim), the state projection (input without gradient: 4 n t d) and the
    readout against the table (6 n t V): the last term is the buffer's."""
    n, t, d = 4, 32, 32

    def flops(target_dim):
        cfg = tiny_config(d_model=d, seq_len=t, target_dim=target_dim)
        obj = get_objective(cfg)
        m = obj.build_block(0)
        w = windows(n, t)
        return measure_step_flops(m, lambda: obj.local_loss(m, 0, w, torch.Generator().manual_seed(0)))

    assert flops(32) - flops(16) == n * t * 16 * (6 * d + 4 * d + 6 * 256)


def test_counting_one_window_and_scaling_equals_counting_the_batch():
    split = resolve_data(str(TEST_CORPUS))
    for objective in ("paper", "forward-chained"):
        cfg = tiny_config(objective=objective, batch_size=4)
        full = LocalRun(cfg, split, torch.device("cpu"), reference=True, small_reference=True)
        one = LocalRun(cfg, split, torch.device("cpu"), reference=True, small_reference=True, flops_batch=1)
        assert [tr.step_flops for tr in one.trainees] == [tr.step_flops for tr in full.trainees]
        assert full.round_flops() > 0


def test_chain_trained_blocks_are_charged_what_their_holders_run():
    """pipeline: the blocks' steps add up to the whole-depth model's step (block b > 0 also computes the
    gradient w.r.t. its input); forward-streamed: block b runs one block's layers and head from the
    activations it receives, no upstream forward (forward-chained's step less its upstream forwards)."""
    split = resolve_data(str(TEST_CORPUS))
    n_blocks, n, t, d = 3, 4, 32, 32
    one = flop_formulas.ar_train_step(n, t, d, 1)
    whole = flop_formulas.ar_train_step(n, t, d, n_blocks)
    fc = LocalRun(tiny_config(objective="forward-chained", n_blocks=n_blocks), split, torch.device("cpu"),
                  reference=False)
    for objective in ("pipeline", "forward-streamed"):
        cfg = tiny_config(objective=objective, n_blocks=n_blocks, batch_size=n, seq_len=t, d_model=d)
        run = LocalRun(cfg, split, torch.device("cpu"), reference=True, small_reference=True)
        obj, w = run.objective, windows(n, t)
        per_block = stage_step_flops(obj, run.blocks, w)
        assert all(p.grad is None for m in run.blocks for p in m.parameters())   # counting leaves none
        assert sum(per_block) == measured_flops(lambda: chain_gradients(obj, run.blocks, w))
        steps = [tr.step_flops for tr in run.trainees[:n_blocks]]
        assert steps == per_block and all(tr.upstream_flops == 0 for tr in run.trainees)
        assert run.trainees[n_blocks].step_flops == whole and run.trainees[-1].step_flops == one
        if objective == "pipeline":
            assert sum(steps) == whole and steps[-1] == one
        else:
            assert steps == [one] * n_blocks
            assert steps == [tr.step_flops - tr.upstream_flops for tr in fc.trainees]
        assert run.round_flops_streamed() == run.round_flops()


# -- learning-rate schedules ----------------------------------------------------------------------------------
def test_cosine_warms_up_then_decays_to_the_floor_at_the_budget_and_constant_stays():
    s = LrSchedule(4e-3, warmup_steps=10, kind="cosine", total_steps=110, final_ratio=0.1)
    assert s.at(0) == pytest.approx(4e-4) and s.at(9) == pytest.approx(4e-3)
    assert s.at(10) == pytest.approx(4e-3)
    assert s.at(60) == pytest.approx(4e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 50 / 99))))
    assert s.at(109) == pytest.approx(4e-4)                # the last step of the budget runs at the floor
    lrs = [s.at(i) for i in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # a wall-time budget passes its progress
    assert s.at(50, progress=0.5) == pytest.approx(4e-3 * 0.55)
    c = LrSchedule(1e-3, warmup_steps=10)
    assert c.at(5) == pytest.approx(6e-4) and c.at(10_000) == 1e-3
    cfg = tiny_config(lr=2e-3, warmup_steps=4)
    assert [lr_at(i, cfg) for i in (0, 3, 99)] == pytest.approx([5e-4, 2e-3, 2e-3])   # the network's: unchanged
    with pytest.raises(ValueError, match="cosine"):
        LrSchedule(1e-3, kind="cosine").at(5)
    with pytest.raises(ValueError, match="schedule"):
        LrSchedule(1e-3, kind="linear")


def test_cosine_local_run_ends_each_trainee_at_the_floor_of_its_own_budget():
    cfg = tiny_config(lr=4e-3, warmup_steps=2)
    run = LocalRun(cfg, resolve_data(str(TEST_CORPUS)), torch.device("cpu"), reference=False,
                   small_reference=True, chain=False, schedule="cosine")
    run.train(Budget(steps=12))
    tr = run.trainees[0]
    assert tr.steps == 12 and tr.opt.param_groups[0]["lr"] == pytest.approx(4e-4)


def test_flop_budgets_parse_and_must_be_turned_into_steps():
    assert Budget.parse("2e13flops").flops == 2e13 and Budget.parse("1.5e12 flops").flops == 1.5e12
    assert str(Budget.parse("2e13flops")) == "2e+13flops"
    for bad in ("0flops", "-1e3flops", "1e999flops", "2e13 flop"):
        with pytest.raises(BudgetError):
            Budget.parse(bad)
    with pytest.raises(BudgetError, match="steps"):
        Budget.parse("1e9flops").done(0, 0.0)


# -- the validation split -------------------------------------------------------------------------------------
def test_validation_is_carved_from_the_end_of_train_never_from_test():
    train = np.arange(1000, dtype=np.int64).astype(np.uint8)
    test = np.full(300, 7, dtype=np.uint8)
    split = DataSplit(train, test, "p", "d", "train.txt", "test.txt")
    training, validation = carve_validation(split, 0.1)
    assert len(training.train) == 900 and len(validation.eval) == 100
    assert np.array_equal(np.concatenate([training.train, validation.eval]), train)
    assert training.eval is test and np.array_equal(validation.train, training.train)
    assert "carved from train" in validation.protocol
    with pytest.raises(DataError):
        carve_validation(split, 0.7)


def test_validation_holds_whole_books_when_the_manifest_lists_them(tmp_path):
    books = [b"A" * 500, b"B" * 300, b"C" * 40, b"D" * 60]
    (tmp_path / "train.txt").write_bytes(b"\n".join(books))
    (tmp_path / "test.txt").write_bytes(b"T" * 200)
    rows = ["ebook\ttitle\tbytes\tsplit"] + [f"{i}\tb{i}\t{len(b)}\ttrain" for i, b in enumerate(books)]
    (tmp_path / "MANIFEST.tsv").write_text("\n".join(rows + ["9\tt\t200\ttest"]) + "\n")
    split = resolve_data(str(tmp_path))
    assert split.train_books == (500, 300, 40, 60)
    training, validation = carve_validation(split, 0.1)     # 10% of 903 bytes: the last two books (101)
    assert bytes(validation.eval) == b"C" * 40 + b"\n" + b"D" * 60
    assert bytes(training.train) == b"A" * 500 + b"\n" + b"B" * 300
    assert "last 2 train book(s)" in validation.protocol
    # a manifest that does not add up to train.txt is ignored (byte fraction instead)
    (tmp_path / "train.txt").write_bytes(b"\n".join(books) + b"extra")
    assert resolve_data(str(tmp_path)).train_books == ()


# -- the paired bootstrap -------------------------------------------------------------------------------------
def test_a_known_shift_gives_an_interval_around_the_shift():
    rng = np.random.default_rng(1)
    base = rng.normal(2.0, 0.3, size=(3, 1024))             # window difficulty, shared by both arms
    a = base + 0.05 + rng.normal(0, 0.02, size=base.shape)
    d = paired_bootstrap(a, base, n_boot=2000)
    assert d.lo < 0.05 < d.hi and d.hi - d.lo < 0.01
    assert d.mean == pytest.approx(float((a - base).mean())) and len(d.per_seed) == 3 and d.excludes_zero


def test_identical_arms_give_an_interval_around_zero():
    rng = np.random.default_rng(2)
    base = rng.normal(2.0, 0.3, size=(5, 1024))
    same = paired_bootstrap(base, base.copy())
    assert same.mean == 0 and same.lo == 0 and same.hi == 0
    a = base + rng.normal(0, 0.05, size=base.shape)          # same expected CE, independent noise
    b = base + rng.normal(0, 0.05, size=base.shape)
    d = paired_bootstrap(a, b)
    assert d.lo < 0 < d.hi and not d.excludes_zero


def test_the_interval_carries_the_spread_between_seeds():
    """Seeds that disagree (a seed-level effect) widen the interval; over many draws it covers the
    true mean about 95% of the time with enough seeds (here 20)."""
    rng = np.random.default_rng(3)
    windows_only = paired_bootstrap(rng.normal(0, 0.05, (1, 1024)), np.zeros((1, 1024)))
    spread = paired_bootstrap(rng.normal(0, 0.05, (5, 1024)) + rng.normal(0, 0.05, (5, 1))[:, :1],
                              np.zeros((5, 1024)))
    assert spread.hi - spread.lo > 3 * (windows_only.hi - windows_only.lo)
    covered = 0
    for trial in range(100):
        r = np.random.default_rng(100 + trial)
        d = r.normal(0, 0.1, (20, 256)) + r.normal(0, 0.03, (20, 1))
        res = paired_bootstrap(d, np.zeros_like(d), n_boot=400, seed=trial)
        covered += res.lo <= 0 <= res.hi
    assert 85 <= covered <= 100


def test_paired_bootstrap_refuses_unpaired_input():
    with pytest.raises(ValueError, match="same shape"):
        paired_bootstrap(np.zeros((2, 10)), np.zeros((3, 10)))
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap(np.array([1.0, np.nan]), np.zeros(2))
    with pytest.raises(ValueError):
        paired_bootstrap(np.zeros(10), np.zeros(10), level=1.5)


@pytest.mark.parametrize("objective", ["paper", "forward-chained", "forward-streamed", "forward-residual", "pipeline",
                                       "pipeline-chunked"])
def test_batched_per_window_scoring_equals_the_window_by_window_definition(objective):
    """These objectives score many windows (paper: and their k samples) in one traversal: each window's
    figure (and extras) must be the one-window loop's (the base class's definition, window i seeded
    ``seed + i``), and must not depend on the batch it is scored in."""
    from blocktrain.blocks.evaluate import per_window_chain_ce
    from blocktrain.blocks.objectives.base import Objective
    from blocktrain.blocks.windows import eval_windows

    cfg = tiny_config(n_blocks=3, objective=objective, chunk_len=4)
    obj = get_objective(cfg)
    assert type(obj).score_per_window is not Objective.score_per_window   # it batches
    torch.manual_seed(0)
    blocks = [obj.build_block(b).eval() for b in range(cfg.n_blocks)]
    with torch.no_grad():   # away from init (a zero-initialised head predicts every window alike)
        for p in (p for m in blocks for p in m.parameters()):
            p.add_(0.05 * torch.randn_like(p))
        for m in blocks[1:]:   # forward-residual: later blocks read through block 0's readout (zeros until then)
            getattr(m, "adopt_readout", lambda first: None)(blocks[0])
    windows = eval_windows(resolve_data(str(TEST_CORPUS), None, seq_len=cfg.seq_len).eval, cfg.seq_len, 10)
    hops = obj.local_hops(blocks)
    loop, loop_extra = Objective.score_per_window(obj, hops, windows, k=3, seed=5)
    batched, extra = obj.score_per_window(hops, windows, k=3, seed=5, batch=4)
    assert batched == pytest.approx(loop, abs=1e-5)
    assert [sorted(e) for e in extra] == [sorted(e) for e in loop_extra]
    for e, f in zip(extra, loop_extra):
        for key in e:
            assert e[key] == pytest.approx(f[key], abs=1e-5)
    assert obj.score_per_window(hops, windows[4:], k=3, seed=9, batch=64)[0] == pytest.approx(batched[4:], abs=1e-5)
    assert per_window_chain_ce(obj, blocks, windows, k=3, seed=5)[0].tolist() == pytest.approx(loop, abs=1e-5)
    assert len(set(round(x, 4) for x in loop)) > 1   # the windows differ: the test compares something
