"""bt-node bench swarm / inference / compression / p2p: the network benchmarks (thin; logic in bench/)."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from .errors import friendly
from .render import emit_json, err_console


def _f(v, spec=".4f") -> str:
    return "-" if v is None else format(v, spec)


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _record(path: str | None, res: dict) -> None:
    """Append one dated JSON line (the command's whole result) to ``path``."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a") as f:
        f.write(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **res},
                           default=str) + "\n")


def _say(quiet: bool):
    t0 = time.time()
    # a message is text, not markup: "train.txt[last 3 train book(s)]" must print as it is
    return None if quiet else (lambda msg: err_console.print(f"[dim]{time.time() - t0:6.0f}s[/] {escape(msg)}"))


# -- bench swarm ---------------------------------------------------------------------------------
def swarm_table(res: dict) -> Table:
    s = res["settings"]
    t = Table(title=f"bench swarm: {s['max_steps']} local steps per worker, chain CE on "
                    f"{s['eval_windows']} held-out windows (K={s['k']}); untrained {res['ce_init']:.3f}")
    for col in ("run", "workers", "chain CE", "vs baseline", "rounds ok/tried (rej, fail; partial)",
                "mean group", "MB sent (averaging)", "MB / formed round", "train s", "CE gain / GB"):
        t.add_column(col, justify="right" if col != "run" else "left")
    for name, r in res["runs"].items():
        rd = r["rounds"]
        groups = [v["mean_group_size"] for v in r["rounds_by_block"].values()]
        t.add_row(name, str(r["workers_n"]), _f(r["chain_ce"]), _f(r.get("ce_minus_baseline"), "+.4f"),
                  f"{rd['succeeded']}/{rd['attempted']} ({rd['rejected']}, {rd['failed']}; {rd.get('partial', 0)})",
                  _f(sum(groups) / len(groups), ".2f") if groups else "-", _mb(r["bytes_sent_total"]),
                  _mb(r["averaging_bytes_sent_per_formed_round"]), _f(r["train_wall_s"], ".0f"),
                  _f(r.get("ce_gain_per_gb"), ".1f"))
    goals = []
    for k, g in res["goals"].items():
        goals.append(f"{k}: {'met' if g['met'] else 'MISSED'} ("
                     + ", ".join(f"{kk}={vv:.3f}" for kk, vv in g.items() if isinstance(vv, float)) + ")")
    t.caption = (f"protocol {res['protocol']}; config {res['config_hash']}. " + "; ".join(goals)
                 + f". Bytes: {res['method']}.")
    return t


@click.command("swarm")
@click.option("--steps", type=click.IntRange(1), default=None,
              help="Local optimizer steps every worker takes (--max-steps) [default: 200; 40 with --tiny].")
@click.option("--average-every", type=click.IntRange(1), default=None,
              help="Local steps between averaging rounds [default: 10; 5 with --tiny].")
@click.option("--compression", "compressions", multiple=True, type=click.Choice(["fp32", "fp16", "8bit"]),
              help="Averaged runs to make, one per value (repeatable) [default: fp32 fp16 8bit; fp32 with --tiny].")
@click.option("--layout", default=None, metavar="B,B,...",
              help="Block of each worker of the averaged runs [default: 0,1,2,3,1,2; 0,1,1 with --tiny].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override the model config.")
@click.option("--data", default="auto", show_default=True,
              help="auto = ../shared WikiText-2 if present (wt2-offline), else HF wikitext-2, else stdlib text.")
@click.option("--eval-windows", type=click.IntRange(1, 64), default=None,
              help="Held-out windows for the final chain CE [default: 64; 8 with --tiny].")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Save CE vs time / bytes as PNG here.")
@click.option("--record", type=click.Path(dir_okay=False), default=None, help="Append a dated JSON line here.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Keep node dirs here.")
@click.option("--tiny", is_flag=True, help="2 blocks, 3 vs 2 workers, tiny model, both networks at once: ~1 minute.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_swarm_cmd(steps, average_every, compressions, layout, overrides, data, eval_windows, plot, record,
                    workdir, tiny, as_json):
    """Gossip-averaged replicas vs one worker per block, at equal per-block steps.

    \b
    Real worker processes on 127.0.0.1: a baseline network (one worker per block, no averaging)
    and one averaged network per --compression (default 6 workers over 4 blocks, blocks 1 and 2
    held twice). Every worker starts from the same step-0 checkpoint and takes exactly --steps
    local steps; then the chain is scored on the same held-out windows.
    Example:
      bt-node bench swarm --plot docs/bench_swarm_ce.png
    """
    from blocktrain.bench.plots import plot_swarm
    from blocktrain.bench.swarm import SwarmBenchSettings, run_bench_swarm   # imports hivemind

    s = SwarmBenchSettings.tiny() if tiny else SwarmBenchSettings()
    s.overrides += list(overrides)
    s.data = data
    if steps is not None:
        s.max_steps = steps
    if average_every is not None:
        s.average_every = average_every
    if compressions:
        s.compressions = list(dict.fromkeys(compressions))
    if eval_windows is not None:
        s.eval_windows = eval_windows
        s.curve_windows = min(s.curve_windows, eval_windows)
    if layout:
        try:
            s.averaged_plan = [int(x) for x in layout.split(",")]
        except ValueError:
            raise click.BadParameter(f"expected block numbers like 0,1,2,3,1,2, got {layout!r}",
                                     param_hint="--layout") from None
    res = run_bench_swarm(s, workdir=workdir, on_progress=_say(as_json))
    if plot:
        res["plot"] = str(plot_swarm(res, plot))
    _record(record, res)
    if as_json:
        emit_json(res)
    else:
        err_console.print(swarm_table(res))
        f32 = res["runs"].get("avg-fp32")
        click.echo(f"baseline chain CE {res['runs']['baseline']['chain_ce']:.4f}"
                   + (f"; averaged (fp32) {f32['chain_ce']:.4f} ({f32['ce_minus_baseline']:+.4f})" if f32 else ""))


# -- bench compression ---------------------------------------------------------------------------
def compression_table(res: dict) -> Table:
    s = res["settings"]
    t = Table(title=f"bench compression: the averaging codec alone ({s['steps']} lock-step steps, a round every "
                    f"{s['average_every']}; chain CE on {s['eval_windows']} held-out windows, K={s['k']})")
    for col in ("run", "workers", "chain CE", "vs fp32", "weights vs fp32 (rel. L2)", "train s"):
        t.add_column(col, justify="right" if col != "run" else "left")
    for name, r in res["runs"].items():
        t.add_row(name, str(r["workers"]), _f(r["chain_ce"]), _f(r.get("delta_ce_vs_fp32"), "+.5f"),
                  _f(r.get("weights_rel_l2_vs_fp32"), ".2e"), _f(r["seconds"], ".0f"))
    goals = [f"{k}: {'met' if g['met'] else 'MISSED'} (delta {g['delta_ce']:+.5f})" for k, g in res["goals"].items()]
    t.caption = f"protocol {res['protocol']}; config {res['config_hash']}. " + "; ".join(goals) + f". {res['method']}."
    return t


@click.command("compression")
@click.option("--steps", type=click.IntRange(1), default=None,
              help="Lock-step optimizer steps of every worker [default: 200; 20 with --tiny].")
@click.option("--average-every", type=click.IntRange(1), default=None,
              help="Steps between averaging rounds [default: 10; 5 with --tiny].")
@click.option("--compression", "compressions", multiple=True, type=click.Choice(["fp32", "fp16", "8bit"]),
              help="Codecs to compare, one averaged run each (repeatable) [default: fp32 fp16 8bit].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override the model config.")
@click.option("--data", default="auto", show_default=True,
              help="auto = ../shared WikiText-2 if present (wt2-offline), else HF wikitext-2, else stdlib text.")
@click.option("--seed", type=int, default=0, show_default=True, help="Data/noise seed shared by every run.")
@click.option("--record", type=click.Path(dir_okay=False), default=None, help="Append a dated JSON line here.")
@click.option("--tiny", is_flag=True, help="2 blocks, 3 workers, tiny model: seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_compression_cmd(steps, average_every, compressions, overrides, data, seed, record, tiny, as_json):
    """Quality cost of the averaging codec alone: same workers, data and rounds, only the codec differs.

    \b
    bench swarm's workers (default 6 over 4 blocks) train in one process in lock step; every
    --average-every steps each block's replicas average through a butterfly all-reduce that
    encodes what crosses the wire with hivemind's codec. Compares the chain CE of each codec
    with fp32 and with no averaging (one worker per block). Bytes: see bench swarm.
    Example:
      bt-node bench compression --json
    """
    from blocktrain.bench.compression import CompressionBenchSettings, run_bench_compression   # imports hivemind

    s = CompressionBenchSettings.tiny() if tiny else CompressionBenchSettings()
    s.overrides += list(overrides)
    s.data, s.seed = data, seed
    if steps is not None:
        s.steps = steps
    if average_every is not None:
        s.average_every = average_every
    if compressions:
        s.compressions = list(dict.fromkeys(compressions))
    res = run_bench_compression(s, say=_say(as_json) or (lambda msg: None))
    _record(record, res)
    if as_json:
        emit_json(res)
    else:
        err_console.print(compression_table(res))
        g = res["goals"].get("fp16_ce_within_0.01")
        if g:
            click.echo(f"fp16 vs fp32 averaging: chain CE {g['delta_ce']:+.5f} nats/byte")


# -- bench inference -----------------------------------------------------------------------------
def inference_table(res: dict) -> Table:
    t = Table(title=f"bench inference: chain of {res['hops']} node processes, {res['delay_ms']:g} ms injected "
                    f"one-way delay per hop (2x per hop round trip)")
    for col in ("bytes out", "mode", "wall s", "traversals", "hop calls", "KB sent", "KB received",
                "ref CE of text", "speedup", "traversal ratio", "bytes ratio"):
        t.add_column(col, justify="right")
    for r in res["lengths"]:
        q = r["quality"]
        for mode, label in (("one_sweep", "one-sweep"), ("autoregressive", "autoregr.")):
            m = r[mode]
            last = mode == "autoregressive"
            t.add_row(str(r["n"]) if not last else "", label, _f(m["wall_s"], ".2f"), str(m["traversals"]),
                      str(m["hop_calls"]), _f(m["bytes_out"] / 1e3, ".1f"), _f(m["bytes_in"] / 1e3, ".1f"),
                      _f(q[f"ref_ce_{mode}"], ".3f"),
                      f"{r['speedup']:.1f}x" if last else "", f"{r['traversal_ratio']:.0f}x" if last else "",
                      f"{r['bytes_total_ratio']:.1f}x" if last else "")
    tr = res["trained"]
    t.caption = (f"protocol {res['protocol']}; blocks trained {tr['steps_per_block']} steps (chain CE "
                 f"{tr['chain_ce']:.3f}), reference {tr['reference_steps']} steps (CE {tr['reference_ce']:.3f}). "
                 f"ref CE of text: "
                 f"nats/byte of the generated bytes under the reference, mean over "
                 f"{res['lengths'][0]['quality']['prompts']} held-out prompts (lower = more likely). "
                 f"Method: {res['method']}.")
    return t


@click.command("inference")
@click.option("--lengths", default=None, metavar="N,N,...",
              help="Output lengths in bytes [default: 32,128,256; 8 with --tiny].")
@click.option("--delay-ms", type=click.FloatRange(0, 10000), default=25.0, show_default=True,
              help="Injected one-way delay per hop (each hop round trip gains twice this).")
@click.option("--train", "train_budget", default=None,
              help="Local training budget of the blocks [default: 240s; 10steps with --tiny].")
@click.option("--train-reference", "reference_budget", default=None,
              help="Local training budget of the reference (the quality judge) [default: 60s; 10steps with --tiny].")
@click.option("--prompt-len", type=click.IntRange(1), default=None, help="Prompt bytes [default: 32; 16 with --tiny].")
@click.option("--quality-prompts", type=click.IntRange(1, 64), default=None,
              help="Held-out prompts for the quality figure [default: 4; 1 with --tiny].")
@click.option("--repeats", type=click.IntRange(1, 20), default=None,
              help="Timed one-sweep runs per length, median [default: 3; 2 with --tiny].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override the model config.")
@click.option("--data", default="auto", show_default=True,
              help="auto = ../shared WikiText-2 if present (wt2-offline), else HF wikitext-2, else stdlib text.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Save wall time vs length as PNG here.")
@click.option("--record", type=click.Path(dir_okay=False), default=None, help="Append a dated JSON line here.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Keep node dirs here.")
@click.option("--tiny", is_flag=True, help="2 blocks, tiny model, 8-byte outputs: well under a minute of work.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_inference_cmd(lengths, delay_ms, train_budget, reference_budget, prompt_len, quality_prompts, repeats,
                        overrides, data, plot, record, workdir, tiny, as_json):
    """One-sweep vs autoregressive generation through a chain of B node processes with injected delay.

    \b
    Blocks and an end-to-end reference are trained locally for a short budget; B nodes (one per
    block) serve them with --inject-delay-ms; a client generates each length both ways and
    reports wall time, traversals, bytes on the wire, and the reference's CE of each text.
    Example:
      bt-node bench inference --delay-ms 25
    """
    from blocktrain.bench.plots import plot_inference
    from blocktrain.bench.inference import InferenceBenchSettings, run_bench_inference

    s = InferenceBenchSettings.tiny() if tiny else InferenceBenchSettings()
    s.overrides += list(overrides)
    s.data, s.delay_ms = data, delay_ms
    if lengths:
        try:
            s.lengths = sorted({int(x) for x in lengths.split(",")})
        except ValueError:
            raise click.BadParameter(f"expected byte counts like 32,128,256, got {lengths!r}",
                                     param_hint="--lengths") from None
    for name, v in (("train_budget", train_budget), ("reference_budget", reference_budget), ("prompt_len", prompt_len),
                    ("quality_prompts", quality_prompts), ("repeats", repeats)):
        if v is not None:
            setattr(s, name, v)
    res = run_bench_inference(s, workdir=workdir, on_progress=_say(as_json))
    if plot:
        res["plot"] = str(plot_inference(res, plot))
    _record(record, res)
    if as_json:
        emit_json(res)
    else:
        err_console.print(inference_table(res))
        click.echo(f"{res['headline_bytes']} bytes at {res['delay_ms']:g} ms per hop: one-sweep is "
                   f"{res['speedup']:.1f}x faster than autoregressive")


# -- bench p2p -----------------------------------------------------------------------------------
@click.command("p2p")
@click.option("--lookups", type=click.IntRange(1), default=20, show_default=True, help="DHT lookups timed.")
@click.option("--hops", type=click.IntRange(1), default=30, show_default=True,
              help="Small hop round trips timed.")
@click.option("--large", type=click.IntRange(1), default=3, show_default=True,
              help="16 MiB streamed hops and 16 MiB block-state downloads timed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_p2p_cmd(lookups, hops, large, as_json):
    """Loopback micro-benchmark of the wire: DHT lookup, hop RPC round trip, streamed throughput.

    \b
    Three DHT nodes on 127.0.0.1 (one a separate server process holding block 0 with a cheap
    deterministic hop); medians. Same as python -m blocktrain.bench.p2p.
    Example:
      bt-node bench p2p --json
    """
    from blocktrain.bench.p2p import run, table   # imports hivemind

    res = run(lookups, hops, large)
    if as_json:
        emit_json(res)
    else:
        click.echo(table(res))
