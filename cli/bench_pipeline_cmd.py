"""bt-node bench pipeline: training along the chain vs block-local, at equal wall time (logic in bench/pipeline.py)."""
from __future__ import annotations

import os
import signal

import click
from rich.table import Table

from .bench_net_cmds import _f, _mb, _record, _say
from .config_opts import lr_items as parse_lr_items
from .errors import friendly
from .render import emit_json, err_console


def pipeline_table(res: dict) -> Table:
    s = res["settings"]
    t = Table(title=f"bench pipeline: {len(s['plan'])} workers (blocks {s['plan']}), {s['train_s']:g}s of training "
                    f"per objective; chain CE on {s['eval_windows']} held-out windows")
    lrs = res.get("lr_by_arm", {})
    for col in ("objective", "chain CE", "train CE", "lr", "untrained", "tokens/s", "CPU-s/worker (min-max)", "MB sent",
                "KB/worker/step", "peak MiB", "stalled s", "lost / done", f"serve {s['gen_bytes']} B: traversals",
                "serve s", "chain minus ref [95%]"):
        t.add_column(col, justify="right" if col != "objective" else "left")
    for name, r in res["runs"].items():
        sv = r["serving"] or {"traversals": "-", "latency_s": None}
        c = r.get("cpu_s_per_worker") or {}
        cpu = f"{c['mean']:.0f} ({c['min']:.0f}-{c['max']:.0f})" if c else "-"
        t.add_row(name, _f(r["chain_ce"]), _f(r.get("chain_ce_train")), _f(lrs.get(name), "g"), _f(r["chain_ce_init"]), _f(r["tokens_per_s"], ".0f"), cpu,
                  _mb(r["bytes_sent_total"]), _f((r["bytes_sent_per_worker_per_step"] or 0) / 1e3, ".1f"),
                  _f(r["peak_rss_mib_max"], ".0f"), _f(r["stalled_s_total"], ".1f"),
                  f"{r['microbatches_lost']} / {r['microbatches_completed']}", str(sv["traversals"]),
                  _f(sv["latency_s"], ".2f"), "")
    for key, label in (("whole", "reference: whole-size, end to end, equal tokens"),
                       ("one_block_cpu", "reference: one block alone, CPU-s of one pipeline worker"),
                       ("one_block", "reference: one block alone, same wall time, this shared machine")):
        ref = res.get("references", {}).get(key)
        if ref:
            cpu = ref.get("cpu_s", ref.get("train_cpu_s"))
            wall = ref["wall_s"] if key == "one_block_cpu" else ref["train_wall_s"]
            d = ref.get("chain_minus")
            vs = f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d else ""
            arm = "whole" if key == "whole" else "one_block"
            t.add_row(label, _f(ref["ce"]), _f(ref.get("ce_train")), _f(lrs.get(arm), "g"), "", _f(ref["tokens"] / max(wall, 1e-9), ".0f"), _f(cpu, ".0f"), "0", "0",
                      _f(ref["peak_rss_mib"], ".0f"), "", f"{ref['steps']} steps", "", "", vs)
    sweep = res.get("lr_sweep")
    chosen = (f"; lr per arm chosen on {sweep['validation']} from {sweep['grid']} (validation CE: "
              + "; ".join(f"{lr}: " + ", ".join(f"{a} {ce:.4f}" for a, ce in row.items())
                          for lr, row in sweep["validation_ce"].items()) + ")") if sweep else ""
    t.caption = (f"protocol {res['protocol']}{chosen}; lr schedule {s.get('lr_schedule', 'constant')}; train CE: on {res.get('train_windows', 0)} windows of the "
                 f"training bytes; serving at {s['delay_ms']:g} ms one-way per hop; chain minus ref: the "
                 f"mean over the held-out windows of the chain's CE minus the reference's, paired bootstrap 95% "
                 f"interval over windows (one seed). {res['method']}.")
    return t


def _lr_grid(text: str) -> tuple[float, ...]:
    try:
        grid = tuple(float(x) for x in text.split(","))
    except ValueError:
        grid = ()
    if len(set(grid)) < 2 or not all(0 < lr < float("inf") for lr in grid):
        raise click.BadParameter(f"expected two or more distinct positive rates like 1e-3,2e-3,4e-3, got {text!r}",
                                 param_hint="--lr-grid")
    return grid


@click.command("pipeline")
@click.option("--train-seconds", type=click.FloatRange(1, 86400), default=None,
              help="Wall time each objective's network trains (default 120; --tiny 10).")
@click.option("--objective", "objectives", multiple=True, help="Objectives to compare (repeatable; default "
                                                                "pipeline, forward-streamed, paper).")
@click.option("--layout", default=None, help="Block per worker, e.g. 0,1,2,3,1,2 (the default).")
@click.option("--compression", type=click.Choice(["fp32", "fp16", "8bit"]), default=None,
              help="--pipeline-compression of every worker (default fp32).")
@click.option("--inflight", type=click.IntRange(1, 4096), default=None,
              help="--pipeline-inflight of every worker: micro-batches in flight along the chain (default 1; "
                   "--preset h200: 8). 1: no stale weights.")
@click.option("--gen-bytes", type=click.IntRange(1, 1024), default=None, help="Bytes generated for the serving cost "
                                                                              "(default 256; --tiny 4).")
@click.option("--delay-ms", type=click.FloatRange(0, 1000), default=None,
              help="One-way delay per hop while serving (default 25; --tiny 5).")
@click.option("--eval-windows", type=click.IntRange(1, 65536), default=None,
              help="Held-out windows every chain and reference is scored on (default 1024; --tiny 8).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override the model config.")
@click.option("--data", default="auto", show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write the bar chart here (PNG; needs matplotlib: the plots extra).")
@click.option("--record", type=click.Path(dir_okay=False), default=None, help="Append the JSON result to this file.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Keep node directories here.")
@click.option("--preset", type=click.Choice(["cpu", "tiny", "h200"]), default="cpu", show_default=True,
              help="cpu: sized for a 2-core machine; tiny: a few seconds per objective, 3 workers over 2 blocks "
                   "(for the test); h200: bf16 on one CUDA device, planned for at most 8 minutes on one H200.")
@click.option("--tiny", is_flag=True, help="Same as --preset tiny.")
@click.option("--device", default=None, help="Device of every worker and reference: cpu, cuda, cuda:N "
                                             "(default: cpu; --preset h200: cuda).")
@click.option("--no-references", is_flag=True, help="Skip the whole-size and one-block reference models.")
@click.option("--no-serving", is_flag=True, help="Skip the serving cost (saves one network start-up per objective).")
@click.option("--no-wall-reference", is_flag=True,
              help="Train the one-block reference only to the CPU-seconds one pipeline worker used (the fair "
                   "budget), not also for the same wall time (saves up to --train-seconds).")
@click.option("--no-whole-reference", is_flag=True,
              help="Skip the whole-size reference at equal tokens (target 1; it costs up to --train-seconds); "
                   "keep the one-block reference.")
@click.option("--curve-every", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds between snapshots of each network's chain during training (scored afterwards against "
                   "one worker's CPU-seconds, the one-block reference at the same CPU-seconds); 0: none.")
@click.option("--weight-stash/--no-weight-stash", default=False, show_default=True,
              help="--pipeline-weight-stash of every worker (pipeline: a backward after a weight change uses "
                   "the weights its forward used).")
@click.option("--flush", is_flag=True, help="--pipeline-flush and --pipeline-accumulate = --inflight on every worker "
                                            "(GPipe: every holder steps once per window of in-flight micro-batches, "
                                            "none stale; the workers' recomputed counts check it).")
@click.option("--recompute", is_flag=True, help="--pipeline-recompute of every worker (a held micro-batch keeps "
                                                "its input, not its graph; its backward runs the forward again).")
@click.option("--layer-checkpoint", is_flag=True,
              help="--pipeline-layer-checkpoint of every worker (a forward with a graph keeps each layer's input "
                   "only; the backward runs each layer again).")
@click.option("--average-every", type=click.IntRange(1), default=None,
              help="Every worker's --average-every: local optimizer steps between averaging rounds of a block's "
                   "replicas (default: the preset's, 10 for cpu).")
@click.option("--average-clock", type=click.FloatRange(min=0), default=None,
              help="Every worker's --average-clock: also a round once in every period of this many seconds of "
                   "the wall clock, at each block's own instant (replicas whose steps are minutes apart still "
                   "meet; default 60, the node's; 0: off).")
@click.option("--pipeline-timeout", "timeout_s", type=click.FloatRange(1, 600), default=None,
              help="Every worker's --pipeline-timeout: a micro-batch's budget at first and at least (default 60).")
@click.option("--pipeline-timeout-max", "timeout_max_s", type=click.FloatRange(1, 600), default=None,
              help="Every worker's --pipeline-timeout-max: the most the adaptive budget grows to (default 600; "
                   "equal to --pipeline-timeout: fixed).")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True,
              help="Every worker's --seed and init_seed; the references' too (a second seed of a run). Worker i "
                   "draws the windows of --data-stream i, so a rerun with the same seed trains on the same windows.")
@click.option("--lr", "lr_items", multiple=True, metavar="ARM=RATE",
              help="Peak learning rate of one arm (repeatable): an objective, whole or one_block, e.g. "
                   "--lr pipeline=4e-3 (default: the config's lr for every arm). Not swept by --lr-sweep.")
@click.option("--lr-sweep", is_flag=True,
              help="Protocol v2: first run the whole bench once per rate of --lr-grid on the training bytes without "
                   "their last books, choose each arm's rate by its CE on those books, then run at the chosen rates "
                   "(the test windows never inform the choice; about 1 + grid size times as long).")
@click.option("--lr-grid", default="1e-3,2e-3,4e-3", show_default=True, help="The rates --lr-sweep tries.")
@click.option("--sweep-fraction", type=click.FloatRange(0.001, 0.4), default=0.025, show_default=True,
              help="--lr-sweep: at least this fraction of the training bytes is carved off as validation (whole "
                   "books where the corpus lists them).")
@click.option("--sweep-windows", type=click.IntRange(1, 65536), default=512, show_default=True,
              help="--lr-sweep: validation windows each arm is scored on.")
@click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True,
              help="constant: warm-up then constant, as a volunteer node trains; cosine: every arm decays to a tenth "
                   "of its peak over its own budget (workers: --lr-decay-seconds = --train-seconds from their "
                   "first step; the one-block reference: one process per budget, wall and CPU; the whole-size "
                   "one: its windows).")
@click.option("--train-windows", type=click.IntRange(0, 65536), default=None,
              help="Windows of the training bytes every chain and reference is also scored on (train CE beside "
                   "held-out CE; default 256; 0: none).")
@click.option("--plan", "plan_only", is_flag=True, help="Print the preset's planned wall time and exit.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_pipeline_cmd(train_seconds, objectives, layout, compression, inflight, gen_bytes, delay_ms, eval_windows, overrides, data, plot,
                       record, workdir, preset, tiny, device, no_references, no_serving, no_wall_reference, no_whole_reference,
                       curve_every,
                       weight_stash, flush, recompute, layer_checkpoint, average_every, average_clock, timeout_s, timeout_max_s, seed, lr_items, lr_sweep, lr_grid, sweep_fraction, sweep_windows,
                       lr_schedule, train_windows, plan_only, as_json):
    """pipeline and forward-streamed vs paper: real node processes, the same wall time each.

    \b
    Each objective's network (default 6 workers over 4 blocks, blocks 1 and 2 held twice) trains
    for the same wall time; then its chain CE (from the final checkpoints, same held-out windows),
    tokens/s, bytes sent, peak memory, stalled time, micro-batches lost, and the serving cost of
    --gen-bytes bytes through one holder per block with --delay-ms per hop (each objective's
    fastest mode: one traversal per byte, per chunk for pipeline-chunked, one for paper). Then the
    references, each in its own process: the whole-size model end to end on as many windows as the
    pipeline network's block 0 used, and the one-block model trained alone, scored when its CPU
    time reaches the CPU-seconds one pipeline worker used (mean; on a real network a worker has its
    own machine) and after the same wall time (here the workers share this machine's cores).
    Example:
      bt-node bench pipeline --plot docs/bench_pipeline.png
    """
    from blocktrain.bench.pipeline import PipelineBenchSettings, plan_seconds, run_bench_pipeline   # hivemind
    from blocktrain.bench.pipeline_plot import plot_pipeline

    if plot:
        try:
            import matplotlib  # noqa: F401   (checked before minutes of training, not after)
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'blocktrain[plots]'") from None
    preset = "tiny" if tiny else preset
    s = {"tiny": PipelineBenchSettings.tiny, "h200": PipelineBenchSettings.h200, "cpu": PipelineBenchSettings}[preset]()
    if device is not None:
        s.device = device
    s.references = not no_references
    s.serving = not no_serving
    s.wall_reference = not no_wall_reference
    s.whole_reference = not no_whole_reference
    s.curve_every = curve_every
    s.seed = seed
    s.weight_stash = weight_stash
    s.flush = flush
    s.recompute = recompute
    s.layer_checkpoint = layer_checkpoint
    s.overrides += list(overrides)
    s.data = data
    s.lrs = parse_lr_items(lr_items)
    s.lr_schedule = lr_schedule
    grid = _lr_grid(lr_grid)
    for name, v in (("train_s", train_seconds), ("compression", compression), ("gen_bytes", gen_bytes),
                    ("delay_ms", delay_ms), ("eval_windows", eval_windows), ("inflight", inflight),
                    ("train_windows", train_windows), ("average_every", average_every),
                    ("average_clock", average_clock), ("timeout_s", timeout_s), ("timeout_max_s", timeout_max_s)):
        if v is not None:
            setattr(s, name, v)
    if s.timeout_max_s < s.timeout_s:   # checked here, not by six workers failing to start
        raise click.BadParameter(f"must be at least --pipeline-timeout ({s.timeout_s:g}), got {s.timeout_max_s:g}",
                                 param_hint="--pipeline-timeout-max")
    if objectives:
        s.objectives = list(dict.fromkeys(objectives))
    if layout:
        try:
            s.plan = [int(x) for x in layout.split(",")]
        except ValueError:
            raise click.BadParameter(f"expected block numbers like 0,1,2,3,1,2, got {layout!r}",
                                     param_hint="--layout") from None
    if plan_only:
        plan = plan_seconds(s)
        emit_json(plan) if as_json else click.echo(f"preset {s.preset}: about {plan['total_s'] / 60:.1f} min planned "
                                                   f"({', '.join(f'{k} {v:.0f}s' for k, v in plan['per_objective_s'].items())}, "
                                                   f"references {plan['references_s']:.0f}s)")
        return
    if s.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise click.UsageError(f"--device {s.device}: no CUDA device here (run --preset h200 on a GPU machine, "
                                   "or --device cpu)")
    def _stop(signum, _frame):   # SIGTERM (timeout, kill): unwind, so every network's finally stops its nodes
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _stop)
    if lr_sweep:
        from blocktrain.bench.pipeline_lr import run_lr_sweep
        res = run_lr_sweep(s, grid=grid, fraction=sweep_fraction, windows=sweep_windows, workdir=workdir,
                           on_progress=_say(as_json))
    else:
        res = run_bench_pipeline(s, workdir=workdir, on_progress=_say(as_json))
    if plot:
        res["plot"] = str(plot_pipeline(res, plot))
    _record(record, res)
    if as_json:
        emit_json(res)
    else:
        err_console.print(pipeline_table(res))


@click.command("pipeline-compare")
@click.argument("records", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--a", "a_arm", type=click.Choice(["chain", "one_block", "one_block_cpu", "whole"]), default="chain",
              show_default=True, help="What of each A record to compare: its chain or one of its references.")
@click.option("--b", "b_arm", type=click.Choice(["chain", "one_block", "one_block_cpu", "whole"]), default="chain",
              show_default=True, help="What of each B record to compare it with.")
@click.option("--objective", default="pipeline", show_default=True, help="Whose chain, in records of several.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_pipeline_compare_cmd(records, a_arm, b_arm, objective, as_json):
    """`bench pipeline --record` results, window by window: RECORDS are pairs A B (one pair per seed).
    Prints the mean CE of A minus B over the same held-out windows (and over the pairs' seeds) with a
    paired bootstrap 95% interval (two-level, seeds and windows, for several pairs) and each pair's
    mean; records scored on other windows are refused. Each file's last line is used.

    \b
    Examples:
      bt-node bench pipeline-compare after.json before.json
      bt-node bench pipeline-compare s0.json s0.json s1.json s1.json s2.json s2.json --b one_block"""
    from blocktrain.bench.pipeline_compare import compare_pairs, load_record
    if len(records) % 2:
        raise click.UsageError(f"{len(records)} records: give them in pairs A B (one pair per seed)")
    pairs = [(records[i], records[i + 1]) for i in range(0, len(records), 2)]
    if len(set(pairs)) != len(pairs):
        raise click.UsageError("a pair of records is given twice: each pair is one seed, counted once")
    res = compare_pairs([(load_record(a), load_record(b)) for a, b in pairs],
                        a_arm=a_arm, b_arm=b_arm, objective=objective)
    if as_json:
        emit_json(res)
        return
    d = res["a_minus_b"]
    for (ra, rb), p, m in zip(pairs, res["pairs"], d["per_seed"]):
        a, b = p["a"], p["b"]
        click.echo(f"A: {a['arm']} of {ra} ({a['date']}, seed {a['seed']}): CE {a['ce']:.4f}")
        click.echo(f"B: {b['arm']} of {rb} ({b['date']}, seed {b['seed']}): CE {b['ce']:.4f}"
                   + (f"  -> A minus B {m:+.4f}" if len(pairs) > 1 else ""))
    over = f"{d['n_windows']} held-out windows" + (f" x {d['n_seeds']} pairs" if len(pairs) > 1 else "")
    how = "two-level paired bootstrap, seeds and windows" if len(pairs) > 1 else "paired bootstrap"
    click.echo(f"A minus B over {over} ({res['windows']['protocol']}): "
               f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] ({how}, {d['level']:.0%})")


@click.command("pipeline-wall-reference")
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.option("--record", type=click.Path(dir_okay=False), required=True,
              help="Append the completed record here (SOURCE is only read).")
@click.option("--json", "as_json", is_flag=True, help="Print the completed record as JSON, not the table.")
@friendly
def bench_pipeline_wall_reference_cmd(source, record, as_json):
    """Add the one-block reference after the same wall time to a `bench pipeline --no-wall-reference`
    record: train it now, in a fresh one-thread process, with the record's own config, data, seed,
    learning rate and schedule, for its --train-seconds; score it on the same held-out windows and
    compare it with the recorded chain window by window. SOURCE's last line is used; the completed
    record is appended to --record (then `pipeline-compare ... --b one_block`). Give it the machine
    to itself, as the bench would (two such references at once take a core each).

    \b
    Example:
      OMP_NUM_THREADS=1 bt-node bench pipeline-wall-reference run32.jsonl --record run32-wall.jsonl"""
    from blocktrain.bench.pipeline import add_wall_reference   # hivemind
    from blocktrain.bench.pipeline_compare import load_record
    if os.path.abspath(record) == os.path.abspath(source):
        raise click.BadParameter("give a new file: SOURCE is only read", param_hint="--record")
    rec = load_record(source)
    def _stop(signum, _frame):   # SIGTERM (timeout, kill): unwind, so the reference's process is stopped
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _stop)
    res = add_wall_reference(rec, on_progress=_say(as_json))
    _record(record, res)
    if as_json:
        emit_json(res)
    else:
        err_console.print(pipeline_table(res))
