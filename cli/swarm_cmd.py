"""bt-node swarm: one command that runs a whole local network, trains, measures and generates."""
from __future__ import annotations

import threading

import click
from rich.live import Live
from rich.table import Table

from blocktrain.blocks.budget import Budget
from .errors import friendly
from .render import emit_json, err_console
from .signals import Interrupted, StopSignals


def _progress_table(statuses: list, frac: float) -> Table:
    t = Table(title=f"local swarm: {frac * 100:.0f}% of the training budget")
    for col in ("node", "block", "step", "loss", "samples/s", "rounds ok/tried"):
        t.add_column(col)
    for i, s in enumerate(statuses):
        if not s:
            t.add_row(f"node{i}", "?", "", "", "", "")
            continue
        me, av = s["self"], s["averaging"]
        t.add_row(f"node{i}", str(me["block"]), str(me["step"]),
                  f"{me['loss']:.3f}" if me["loss"] is not None else "-", f"{me['throughput']:.1f}",
                  f"{av['succeeded']}/{av['attempted']}")
    return t


@click.command("swarm")
@click.option("--nodes", type=click.IntRange(1, 32), default=None,
              help="Node processes (default: one per block plus one replica of block 1).")
@click.option("--budget", default="120s", show_default=True, help="Training wall time, e.g. 120s or 5m.")
@click.option("--data", default="auto", show_default=True,
              help="auto = ../shared WikiText-2 if present, else HF wikitext-2, else the Python stdlib's text.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override the swarm's model config, e.g. --set objective=paper (default objective: pipeline).")
@click.option("--http-port", type=int, default=None, help="HTTP port of the first node (with --keep-running).")
@click.option("--keep-running", is_flag=True, help="Keep the network serving until Ctrl-C.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Node dirs (default: a temp dir).")
@click.option("--prompt", default="The ", show_default=True)
@click.option("--gen-bytes", type=click.IntRange(1, 1023), default=48, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def swarm(nodes, budget, data, overrides, http_port, keep_running, workdir, prompt, gen_bytes, as_json):
    """Start a local network of N node processes, train, average, generate, measure, shut down.

    The run trains `pipeline` (backprop along the chain of holders) unless --set objective=... names
    another (`paper`: the paper's block-local objective). Replicas of a block average every 10 steps
    and at each 5 s of the wall clock (the nodes' --average-clock 5), so they meet however their
    steps drift apart.

    \b
    Example:
      bt-node swarm --budget 120s
      bt-node swarm --budget 120s --set objective=paper
      bt-node swarm --nodes 6 --budget 5m --keep-running --http-port 8000
    """
    from blocktrain.node.swarm.launcher import kill_all, stop_running
    from blocktrain.node.swarm.run import run_swarm   # imports hivemind

    b = Budget.parse(budget)
    if b.seconds is None:
        raise click.BadParameter("the swarm budget is wall time, e.g. 120s", param_hint="--budget")
    live = Live(console=err_console, refresh_per_second=1, transient=True) if not as_json else None

    def show(statuses, frac):
        if live is not None:
            live.update(_progress_table(statuses, frac))

    # Ctrl-C / SIGTERM: the nodes leave gracefully (run_swarm stops them on its way out, or the
    # keep-running wait ends); a second signal SIGKILLs them and exits at once
    stop = threading.Event()
    signals = StopSignals(on_first=stop.set, on_second=kill_all).install()
    try:
        if live is not None:
            live.start()
        try:
            with signals.interrupting():
                res = run_swarm(nodes=nodes, budget_s=b.seconds, data=data, overrides=list(overrides),
                                http_port=http_port, keep_running=keep_running, workdir=workdir,
                                prompt=prompt.encode(), gen_bytes=gen_bytes, on_progress=show)
        finally:
            if live is not None:
                live.stop()
        _report(res, as_json)
        if res.get("first_node_http"):
            err_console.print(f"network kept running; first node's HTTP API: {res['first_node_http']} "
                              "(Ctrl-C stops)")
            while not stop.wait(1.0):
                pass
    except Interrupted:
        err_console.print("stopped before the run finished")
    finally:
        stop_running()   # every node this command started, whatever ended it


def _report(res: dict, as_json: bool) -> None:
    res.pop("_swarm", None)
    if as_json:
        emit_json(res)
        return
    err_console.print(f"objective: {res['objective']}; data: {res['data']} (protocol {res['protocol']})")
    err_console.print(f"averaging rounds (replicated blocks): {res['averaging_rounds']} "
                      f"{res['averaging_rounds_by_block']}")
    err_console.print(f"chain CE on held-out text: {res['chain_ce_start']:.3f} -> {res['chain_ce']:.3f} "
                      f"nats/byte ({res['ce_kind']}; ln 256 = 5.545)")
    route = " -> ".join(f"b{h['block']}@{h['peer'][-6:]}" for h in res["route"])
    err_console.print(f"route: {route}")
    click.echo(res["prompt"] + res["generated"])
