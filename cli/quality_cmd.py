"""bt-node bench quality: protocol v2 (the default: arms at equal measured FLOPs, per-arm learning rates
from a validation sweep, paired per-window intervals over seeds; logic in bench/quality_v2.py) and
protocol v1 (the interleaved chain-plus-references run behind BENCHMARKS.md's v1 records)."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import click
import torch

from blocktrain.bench.quality import quality_result, quality_run
from blocktrain.bench.quality_presets import PRESETS, Preset, predict_seconds
from blocktrain.bench.quality_report import markdown_table, summarize
from blocktrain.bench.quality_v2 import (SWEEP_MIN_MARGIN, Settings, Study, StudyError, arm_kind, check_arms,
                                         sweep_margins, write_json)
from blocktrain.blocks.budget import Budget
from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.device import pick_device
from .config_opts import build_config, config_options, lr_items
from .errors import friendly
from .local_cmds import data_options, report, train_with_progress
from .render import emit_json, err_console


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what}: expected comma-separated whole numbers, got {text!r}") from None
    if not out or any(x < 0 for x in out) or len(set(out)) != len(out):
        raise click.BadParameter(f"{what}: expected distinct whole numbers >= 0, got {text!r}")
    return out


def _lr_pairs(items: tuple[str, ...]) -> dict[str, float]:
    return {arm_kind(arm): lr for arm, lr in lr_items(items).items()}


def _machine(device: torch.device) -> dict:
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "nproc": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


@click.command("quality")
@data_options
@config_options
@click.option("--protocol", type=click.Choice(["v2", "v1"]), default="v2", show_default=True,
              help="v2: arms trained apart at equal measured FLOPs, per-arm lr, paired intervals over seeds. "
                   "v1: the chain and both references interleaved in one run (BENCHMARKS.md's v1 records).")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None,
              help="v2 defaults: tiny (tests, seconds on a CPU), cpu (BENCHMARKS.md), h200 (one H200, bf16, "
                   "planned for under 8 minutes at the rates one H200 run measured; --plan says). Options given "
                   "here win.")
@click.option("--arms", default=None, help="v2, comma-separated: objectives (chains), one-block, whole, "
                                           "one-block@streamed [default: --objective's chain,one-block,whole].")
@click.option("--budget", default=None,
              help="Per arm. v2: '2e13flops' (measured FLOPs), '500steps' (the first arm's rounds; the others "
                   "get what they cost in FLOPs) or a wall time ('300s'). v1: the chain's '500steps' or a "
                   "wall time. [default: 120s]")
@click.option("--seeds", default=None, help="v2: comma-separated seeds (each sets init and data order) "
                                            "[default: --seed].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--lr-sweep/--no-lr-sweep", default=None,
              help="v2: choose each arm's lr from the grid {1e-3, 2e-3, 4e-3} on a validation part carved "
                   "from train (short runs of --sweep-fraction of the budget).")
@click.option("--sweep-fraction", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="v2: the sweep's share of each arm's budget [default: 0.25].")
@click.option("--lr", "lr_items", multiple=True, metavar="ARM=RATE",
              help="v2: fix an arm's learning rate (wins over the sweep), e.g. --lr whole=2e-3.")
@click.option("--schedule", type=click.Choice(["cosine", "constant"]), default="cosine", show_default=True,
              help="v2: warm-up then cosine decay to each arm's own budget, or warm-up then constant.")
@click.option("--device", default="auto", show_default=True)
@click.option("--k", "k", type=click.IntRange(min=1), default=None, help="Chain samples averaged when scoring [4].")
@click.option("--eval-windows", type=click.IntRange(min=2), default=None,
              help="Held-out windows, the same for every arm [v2: 1024, v1: 64].")
@click.option("--train-windows", type=click.IntRange(min=2), default=None,
              help="v2: fixed train windows for the train CE [1024].")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="v2: study folder; every result is written as it comes and reused on a rerun.")
@click.option("--plan", is_flag=True, help="v2: print the arms' measured FLOPs, steps and epochs; train nothing.")
@click.option("--bootstrap", type=click.IntRange(min=100), default=4000, show_default=True,
              help="v2: bootstrap replicates of each paired interval.")
@click.option("--upstream-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="v1, forward-chained/-residual: block b refreshes its snapshots of blocks < b every N rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_quality(data, eval_data, config_path, objective, overrides, protocol, preset, arms, budget, seeds,
                  seed, lr_sweep, sweep_fraction, lr_items, schedule, device, k, eval_windows, train_windows,
                  out, plan, bootstrap, upstream_every, as_json):
    """Block-local chains vs end-to-end references at EQUAL training FLOPs on the same held-out windows.

    \b
    Protocol v2 (default): each arm (a chain, the one-block reference, the whole-size model trained end
    to end) is trained apart to the same measured FLOPs, at its own learning rate, with cosine decay to
    its budget; all are scored on the same held-out windows; differences are paired window by window
    with a bootstrap 95% interval over windows and seeds.
    Examples:
      bt-node bench quality --data ../shared/data/gutenberg --preset cpu --lr-sweep --out runs/v2
      bt-node bench quality --data ../shared/data/gutenberg --preset h200 --plan
      bt-node bench quality --protocol v1 --data ../shared/data/wikitext-2-raw --budget 120s --json
    """
    if protocol == "v1":
        v2_only = {"--preset": preset, "--arms": arms, "--seeds": seeds, "--lr-sweep": lr_sweep,
                   "--sweep-fraction": sweep_fraction, "--lr": lr_items, "--train-windows": train_windows,
                   "--out": out, "--plan": plan or None}
        given = [name for name, v in v2_only.items() if v]
        if given:
            raise click.UsageError(f"{', '.join(given)}: protocol v2 only")
        cfg = build_config(config_path, objective, overrides)
        split = resolve_data(data, eval_data, seq_len=cfg.seq_len)
        run = quality_run(cfg, split, pick_device(device), seed=seed, upstream_every=upstream_every)
        train_with_progress(run, Budget.parse(budget or "120s"), as_json)
        res = quality_result(run, k=k or 4, eval_windows=eval_windows or 64)
        report(res, as_json, "bench quality v1 (equal training FLOPs)")
        return
    if upstream_every != 1:
        raise click.UsageError("--upstream-every: protocol v1 only (v2 chains read live upstream blocks)")
    _run_v2(data, eval_data, config_path, objective, overrides, PRESETS[preset] if preset else Preset(), preset,
            arms, budget, seeds, seed, lr_sweep, sweep_fraction, lr_items, schedule, device, k, eval_windows,
            train_windows, out, plan, bootstrap, as_json)


def _run_v2(data, eval_data, config_path, objective, overrides, p: Preset, preset_name, arms, budget, seeds, seed,
            lr_sweep, sweep_fraction, lr_items, schedule, device, k, eval_windows, train_windows, out, plan,
            bootstrap, as_json):
    cfg = build_config(config_path, objective,
                       tuple(f"{key}={json.dumps(v)}" for key, v in p.overrides.items()) + tuple(overrides))
    arm_list = [a.strip() for a in arms.split(",") if a.strip()] if arms else list(p.arms) or \
        [cfg.objective, "one-block", "whole"]
    budget_obj = Budget.parse(budget or p.budget)
    check_arms(arm_list, budget_obj)
    seed_list = _int_list(seeds, "--seeds") or (list(p.seeds) if preset_name else [seed])
    dev = pick_device(device)
    if p.needs_cuda and dev.type != "cuda" and not plan:
        raise click.UsageError(f"--preset {preset_name} is sized for a GPU ({p.note}); no CUDA device here. "
                               "Use --plan to see what it would run, or --preset tiny / cpu.")
    settings = Settings(cfg, budget_obj, eval_windows=eval_windows or p.eval_windows,
                        train_windows=train_windows or p.train_windows, k=k or p.k, schedule=schedule,
                        sweep_fraction=sweep_fraction or p.sweep_fraction)
    split = resolve_data(data, eval_data, seq_len=cfg.seq_len)
    study = Study(settings, split, dev, out=Path(out) if out else None, log=lambda m: err_console.print(m),
                  flops_batch=1 if plan else None)
    machine = _machine(dev)
    if plan:
        res = study.plan(arm_list, seed_list, lr_sweep if lr_sweep is not None else p.lr_sweep)
        if p.timing is not None:
            swept = lr_sweep if lr_sweep is not None else p.lr_sweep
            res["predicted"] = predict_seconds(p.timing, res, sweep_fraction=settings.sweep_fraction,
                                               n_rates=len(settings.lr_grid), swept=bool(swept))
        res.update(preset=preset_name, config=cfg.to_dict(), machine=machine)
        if as_json:
            emit_json(res)
        else:
            for row in res["arms"]:
                click.echo(f"{row['arm']}: {row['rounds']} rounds x {row['flops_per_round']:.3g} FLOPs = "
                           f"{row['flops']:.3g}; {row['epochs']:.2f} epochs")
            pred = res.get("predicted")
            click.echo(f"total {res['total_flops']:.3g} FLOPs (sweep {res['sweep_flops']:.3g})"
                       + (f"; about {pred['total_s'] / 60:.1f} min at the rates measured on {pred['timing_source']}"
                          if pred else ""))
        return
    lrs, sources, sweep = _choose_lrs(study, arm_list, lr_sweep if lr_sweep is not None else p.lr_sweep,
                                      _lr_pairs(lr_items), cfg.lr)
    fresh = study.run_arms(arm_list, seed_list, lrs)
    runs = study.stored_runs() if out else fresh
    summary = summarize(runs, n_boot=bootstrap, order=arm_list)
    res = {"protocol": "v2", "preset": preset_name, "data_protocol": split.protocol, "data": split.description,
           "settings": settings.key(split), "arms": arm_list, "seeds": seed_list, "machine": machine,
           "lr": {key: {"lr": lrs[key], "source": sources[key]} for key in lrs}, "lr_sweep": sweep,
           "summary": summary, "table": markdown_table(summary)}
    if out:
        write_json(Path(out) / "summary.json", res)
    if as_json:
        emit_json(res)
    else:
        click.echo(f"protocol v2, {split.protocol}: {split.description}")
        for key, v in res["lr"].items():
            click.echo(f"lr {key}: {v['lr']:g} ({v['source']})")
        click.echo(res["table"])


def _choose_lrs(study: Study, arms: list[str], sweep_now: bool, fixed: dict[str, float],
                default: float) -> tuple[dict[str, float], dict[str, str], dict | None]:
    """Each arm kind's lr: --lr, else the sweep (run now, or stored in the study folder), else the config's."""
    sweep = None
    stored = study.out / "lr_sweep.json" if study.out is not None else None
    if sweep_now:
        sweep = study.lr_sweep([a for a in arms if arm_kind(a) not in fixed] or arms)
        if stored is not None:
            write_json(stored, sweep)
    elif stored is not None and stored.exists():
        sweep = json.loads(stored.read_text())
    lrs, sources = {}, {}
    margins = sweep_margins(sweep["scores"]) if sweep else {}   # a stored sweep may predate the field
    for key in dict.fromkeys(arm_kind(a) for a in arms):
        if key in fixed:
            lrs[key], sources[key] = fixed[key], "--lr"
        elif sweep and key in sweep["choice"]:
            lrs[key], sources[key] = sweep["choice"][key], "validation sweep"
            if margins.get(key, float("inf")) < SWEEP_MIN_MARGIN:
                sources[key] = f"validation sweep, undecided (margin {margins[key]:.3f})"
                err_console.print(f"[yellow]lr sweep: {key}'s best rate beat the next by {margins[key]:.3f} nats/byte "
                                  f"on validation (under {SWEEP_MIN_MARGIN}): the rates were not told apart, so "
                                  f"{sweep['choice'][key]:g} is close to a guess (a larger --sweep-fraction "
                                  f"trains further before choosing)[/yellow]")
        else:
            lrs[key], sources[key] = default, "config (not swept)"
    unknown = set(fixed) - set(lrs)
    if unknown:
        raise StudyError(f"--lr names arms not trained here: {', '.join(sorted(unknown))}")
    return lrs, sources, sweep
