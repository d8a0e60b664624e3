"""bt-node seed / join / generate / status / export: the network commands (thin; logic in node/).

(Over 400 lines on purpose: five commands share one set of node options, the ready file, the banner
and the progress line; split by command, each file would repeat the option plumbing.)
"""
from __future__ import annotations

import contextvars
import functools
import json
import os
import time
from pathlib import Path

import click
from rich.live import Live
from rich.table import Table

from ..node.options import MAX_SEED, MAX_STREAM, NEW_RUN_OBJECTIVE, NodeOptions
from .config_opts import build_config, config_options
from .errors import friendly
from .render import emit_json, err_console, plain, terminal_safe
from .signals import Interrupted, StopSignals


def node_options(fn):
    opts = [
        click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
                     help="Where this node keeps its identity and block checkpoints "
                          "(default: ./bt-node-<run>)."),
        click.option("--block", type=click.IntRange(min=0), default=None,
                     help="Hold this block (default: the least-held one)."),
        click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True),
        click.option("--host", default="127.0.0.1", show_default=True, help="Interface for p2p traffic."),
        click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
                     help="TCP port for p2p (0: any free)."),
        click.option("--announce-host", default=None, help="Public IP to announce (behind NAT/port forward)."),
        click.option("--http-port", type=click.IntRange(0, 65535), default=None,
                     help="Serve the HTTP API and web page here."),
        click.option("--http-host", default="127.0.0.1", show_default=True),
        click.option("--average-every", type=click.IntRange(min=1), default=20, show_default=True,
                     help="Local steps between averaging rounds with same-block peers."),
        click.option("--average-period", type=click.FloatRange(min=0, min_open=True), default=10.0,
                     show_default=True,
                     help="Seconds between averaging rounds while not training (after --max-steps)."),
        click.option("--average-clock", type=click.FloatRange(min=0), default=60.0, show_default=True,
                     help="Also try a round once in every period of this many seconds of the wall clock "
                          "(UTC), training or not: the same instant on every holder of a block (the blocks' "
                          "instants spread over the period), so replicas whose steps are "
                          "minutes apart (a slow pipeline) still meet; 0: off, rounds follow --average-every "
                          "only (and --average-period while not training)."),
        click.option("--checkpoint-every", type=click.IntRange(min=1), default=100, show_default=True),
        click.option("--eval-every", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="Seconds between held-out chain CE measurements through the network (0: off)."),
        click.option("--max-steps", type=click.IntRange(min=0), default=None,
                     help="Stop training after N steps; keep serving."),
        click.option("--train-duty", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                     envvar="BT_TRAIN_DUTY", show_envvar=True,
                     help="Share of wall time this node's own training may keep busy (0.25: a step, then three "
                          "times as long idle; a pipeline block 0 paces its micro-batches alike, by their compute on "
                          "this node, not their round trip). Serving, "
                          "averaging and other blocks' pipeline requests are not throttled."),
        click.option("--averaging-compression", type=click.Choice(["fp32", "fp16", "8bit"]), default="fp32",
                     show_default=True, help="What averaging rounds send: fp32 weights, fp16 (half the "
                                             "bytes) or uniform 8-bit quantization (about a quarter)."),
        click.option("--inject-delay-ms", type=click.FloatRange(0, 10000), default=0.0, show_default=True,
                     help="Benchmark/testing knob: wait this one-way delay when a hop request arrives and "
                          "again before its answer leaves (each hop's round trip gains 2x; see BENCHMARKS.md)."),
        click.option("--upstream-refresh", type=click.FloatRange(1, 86400), default=30.0, show_default=True,
                     help="forward-chained and forward-residual runs only: seconds between re-downloads of the blocks before this "
                          "node's block, whose outputs it trains on."),
        click.option("--rebalance/--no-rebalance", default=True, show_default=True,
                     help="Move to a block with far fewer holders when this one has many more (same policy as "
                          "`bt-node bench simulate`); --no-rebalance pins the block. Forward-chained and "
                          "forward-residual nodes stay on their block."),
        click.option("--rebalance-dwell", type=click.FloatRange(0, 86400), default=600.0, show_default=True,
                     help="Seconds a block is held before the node may move away from it (a rescue of a block "
                          "down to one ready holder does not wait)."),
        click.option("--state-sources", type=click.IntRange(1, 16), default=2, show_default=True,
                     help="How many holders' states a late join or a move downloads and compares before "
                          "training one: it keeps the one with the best held-out loss (its own check loss, "
                          "or the chain's with it in place), so a holder offering an untrained or damaged "
                          "block loses to an honest one. They download at once; on a downlink no faster than a "
                          "holder's uplink each extra source adds one transfer: 1 takes the first acceptable "
                          "state (one download)."),
        click.option("--announce-ttl", "ttl", type=click.FloatRange(6, 3600), default=30.0, show_default=True,
                     help="Seconds this node's announcement lives in the DHT; it is refreshed every third of "
                          "it, and the rebalancing check runs as often. A node that dies unannounced drops "
                          "out of others' routing within it; shorter means more DHT traffic."),
        click.option("--lr-decay-seconds", type=click.FloatRange(1, 1e7), default=None,
                     help="A budgeted run (benchmarks): decay the learning rate by a cosine to a tenth of its "
                          "peak over this many seconds of this node's training, from its first step. Default: "
                          "warm-up then constant (a volunteer run has no end)."),
        click.option("--seed", "sample_seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                     help="Seed of the training windows this node draws (with its data stream) and of its "
                          "sampling noise."),
        click.option("--data-stream", type=click.IntRange(0, MAX_STREAM), default=None,
                     help="Which stream of training windows this node draws, with --seed. Default: one of its "
                          "own from its peer id, so members draw different windows; a benchmark gives each "
                          "worker its index, so a rerun draws the same windows. A resumed checkpoint continues "
                          "its saved stream."),
        click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
                     help="Write a JSON line with peer id, addresses and ports once serving (for scripts)."),
        click.option("--quiet", is_flag=True, help="No live progress line."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _run_node(opts: NodeOptions, ready_file: str | None, quiet: bool, banner: str) -> None:
    from ..node.node import Node   # imports hivemind: only for network commands

    node = Node(opts)
    signals = StopSignals(on_first=node.stop_event.set).install()
    try:
        with signals.interrupting():   # a signal while starting cuts the start short
            node.start()
        _announce_ready(node, opts, ready_file, banner)
        if quiet or not err_console.is_terminal:
            node.wait()
        else:
            with Live(_progress(node.snapshot()), console=err_console, refresh_per_second=1, transient=True) as live:
                while not node.stop_event.wait(1.0):
                    live.update(_progress(node.snapshot()))
    except Interrupted:
        pass
    finally:
        t0 = time.monotonic()
        node.stop()
        steps = ", ".join(f"{name} {took:.2f}" for name, took in node.teardown.timings)
        problems = "; problems: " + "; ".join(node.teardown.errors) if node.teardown.errors else ""
        if node.teardown.timings or problems:   # nothing started (a bad directory, file or flag): nothing to leave
            click.echo(f"left the run in {time.monotonic() - t0:.2f} s ({steps}){problems}", err=True)
    if node.failure:
        raise click.ClickException("node stopped after an error: " + node.failure)


def join_command(run_address: str, peer_id: str, maddr: str) -> str:
    """What another member types to join through this node: the run address pins the run's seeder, so
    a node that is not the seeder gives its own address as the initial peer (``RUN@MULTIADDR`` would
    pin this node as the seeder, and no manifest of it exists)."""
    run_id, _, seeder = run_address.partition("@")
    if seeder == peer_id:
        return f"bt-node join --run {run_id}@{maddr}"
    return f"bt-node join --run {run_address} --initial-peers {maddr}"


def _announce_ready(node, opts: NodeOptions, ready_file: str | None, banner: str) -> None:
    """The ready file (for scripts) and the banner, with the ports the node actually bound."""
    st = node.snapshot()
    me = st.self
    info = {"peer_id": me["peer_id"], "maddrs": me["maddrs"], "run_id": st.run["run_id"],
            "run_address": st.run["address"], "block": me["block"],
            "http_port": me["http_port"], "data": st.run["data"], "resumed": me["resumed"],
            "downloaded_state": me["downloaded_state"], "late_join": me["late_join"], "reachability": me["reachability"], "pid": os.getpid()}
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(info) + "\n")
        tmp.replace(ready_file)
    err_console.print(f"[bold green]{banner}[/] run [bold]{info['run_id']}[/], block {info['block']} of "
                      f"{st.run['n_blocks']}; data: {info['data']}")
    first = (info["maddrs"] or ["?"])[0]
    err_console.print(f"Run address: [bold]{info['run_address']}[/] (members who pass it believe only this "
                      "run's seeder)", soft_wrap=True)
    if info["reachability"] == "public":   # one unbroken line, also in a log file (rich wraps at 80 columns)
        err_console.print(f"Others join with:\n  {join_command(info['run_address'], info['peer_id'], first)}",
                          soft_wrap=True, markup=False, highlight=False)
    else:
        err_console.print(f"[yellow]Other peers cannot dial this node[/] (behind NAT or a firewall): it trains and "
                          f"averages, and serves its block only through a relay ({info['reachability']}; "
                          f"see /v1/status). Others should join through a reachable node.")
    if info["http_port"]:
        err_console.print(f"HTTP API and web page: http://{opts.http_host}:{info['http_port']}/")


def _progress(st) -> Table:
    """One line of progress from a NodeStatus."""
    me, a = st.self, st.averaging
    peers = sum(1 for blk in st.blocks if blk["block"] == me["block"] for h in blk["holders"] if not h["is_self"])
    last = "-" if not a["last_round_time"] else f"{time.time() - a['last_round_time']:.0f}s ago ({a['last_verdict']})"
    table = Table.grid(padding=(0, 2))
    table.add_row(f"step {me['step']}", f"loss {me['loss']:.3f}" if me["loss"] is not None else "loss -",
                  f"{me['throughput']:.1f} samples/s", f"peers of block {me['block']}: {peers}",
                  f"rounds ok {a['succeeded']}/{a['attempted']}", f"last round {last}")
    return table


def _common(checkpoint_dir, run_id, *, sample_seed: int, **kw) -> NodeOptions:
    """NodeOptions from a command's own arguments and ``node_options``' (named as NodeOptions' fields,
    but for ``--seed``, the sampling seed)."""
    d = checkpoint_dir or f"bt-node-{run_id or 'run'}"
    return NodeOptions(checkpoint_dir=Path(d), run_id=run_id, seed=sample_seed, **_PRIVATE_RUN.get(),
                       **_PIPELINE.get(), **kw)


RUN_HELP = ("Which run: RUN, or its run address RUN@SEEDER_PEER_ID (believe only that seeder's manifest), "
            "or RUN@/ip4/HOST/tcp/PORT/p2p/SEEDER_PEER_ID (also a peer to start from). Default: the run "
            "the initial peer serves.")


def _run_address(value):
    """click callback: parse a run address; clear errors for bad ones."""
    from ..p2p.records import RecordError, parse_run_address
    try:
        return parse_run_address(value)
    except RecordError as e:
        raise click.BadParameter(str(e)) from None


def _peers(initial_peers, address) -> list[str]:
    from ..p2p.addresses import parse_initial_peers
    peers = parse_initial_peers(list(initial_peers)) + ([address.bootstrap] if address.bootstrap else [])
    if not peers:
        raise click.UsageError("give --initial-peers MULTIADDR, or a run address with a multiaddr "
                               "(--run RUN@/ip4/HOST/tcp/PORT/p2p/PEERID)")
    return peers


# -- private runs (node/auth.py): --allow-peer / --run-secret-file, handed to _common ----------
_PRIVATE_RUN: contextvars.ContextVar[dict] = contextvars.ContextVar("bt_private_run", default={})


def _check_peer_ids(_ctx, _param, values):
    from ..node.auth import validate_peer_id
    try:
        return tuple(validate_peer_id(v) for v in values)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def private_run_options(fn):
    """--allow-peer PEERID (repeatable) and --run-secret-file FILE for seed and join, and
    --operator-token-file FILE (who may ask the HTTP API for operator actions)."""
    @functools.wraps(fn)
    def wrapper(*args, allow_peers=(), run_secret_file=None, operator_token_file=None, **kwargs):
        _PRIVATE_RUN.set({"allowed_peers": frozenset(allow_peers) if allow_peers else None,
                          "run_secret_file": Path(run_secret_file) if run_secret_file else None,
                          "operator_token_file": Path(operator_token_file) if operator_token_file else None})
        return fn(*args, **kwargs)
    wrapper = click.option(
        "--operator-token-file", default=None, metavar="FILE",
        help="HTTP API: clients not on this machine may start operator actions (POST /v1/average, "
             "/v1/eval) with 'Authorization: Bearer <the file's token>' (>= 16 printable bytes, read once "
             "at start). Without it those actions are local-only (127.0.0.1 / ::1).")(wrapper)
    wrapper = click.option(
        "--run-secret-file", type=click.Path(exists=True, dir_okay=False), default=None,
        help="Private run: a shared secret (>= 16 bytes) folded into the averaging group name, so peers "
             "without it never find this node's averaging group. See RELIABILITY.md.")(wrapper)
    wrapper = click.option(
        "--allow-peer", "allow_peers", multiple=True, metavar="PEERID", callback=_check_peer_ids,
        help="Private run: only these peer ids (repeatable) may call this node's RPCs (hops, state "
             "download) or average with it; others get an 'unauthorized' error.")(wrapper)
    return wrapper


# -- chain-trained runs (node/pipeline): --pipeline-*, handed to _common ------------------------------
_PIPELINE: contextvars.ContextVar[dict] = contextvars.ContextVar("bt_pipeline", default={})


def pipeline_options(fn):
    """--pipeline-inflight / -accumulate / -compression / -timeout / -timeout-max / -weight-stash / -flush /
    -recompute / -layer-checkpoint / -loss-screen / -check-rate for seed and join."""
    @functools.wraps(fn)
    def wrapper(*args, pipeline_inflight=1, pipeline_accumulate=1, pipeline_compression="fp32",
                pipeline_timeout=60.0, pipeline_timeout_max=600.0, pipeline_weight_stash=False, pipeline_flush=False,
                pipeline_recompute=False, pipeline_layer_checkpoint=False, pipeline_loss_screen=0.0,
                pipeline_check_rate=0.0, **kwargs):
        _PIPELINE.set({"pipeline_inflight": pipeline_inflight, "pipeline_accumulate": pipeline_accumulate,
                       "pipeline_compression": pipeline_compression, "pipeline_timeout": pipeline_timeout,
                       "pipeline_timeout_max": pipeline_timeout_max,
                       "pipeline_weight_stash": pipeline_weight_stash, "pipeline_flush": pipeline_flush,
                       "pipeline_recompute": pipeline_recompute,
                       "pipeline_layer_checkpoint": pipeline_layer_checkpoint,
                       "pipeline_loss_screen": pipeline_loss_screen, "pipeline_check_rate": pipeline_check_rate})
        return fn(*args, **kwargs)
    opts = [
        click.option("--pipeline-inflight", type=click.IntRange(1, 4096), default=1, show_default=True,
                     help="pipeline and forward-streamed runs, holders of block 0: micro-batches kept in flight "
                          "along the chain (1: no backward meets weights newer than its forward's; more overlap "
                          "the stages but train on stale weights, see BENCHMARKS.md)."),
        click.option("--pipeline-accumulate", type=click.IntRange(1, 4096), default=1, show_default=True,
                     help="pipeline and forward-streamed runs: micro-batches whose gradients make one optimizer "
                          "step of this node's block."),
        click.option("--pipeline-compression", type=click.Choice(["fp32", "fp16", "8bit"]), default="fp32",
                     show_default=True, help="pipeline and forward-streamed runs: how this node sends activations (fp16: "
                                             "half the bytes, 8bit: about a quarter); gradients go back as "
                                             "their caller sent."),
        click.option("--pipeline-timeout", type=click.FloatRange(1, 600), default=60.0, show_default=True,
                     help="pipeline and forward-streamed runs, block 0: seconds a micro-batch may take through "
                          "the chain and back before it is counted lost, at first and at least; the budget then "
                          "follows the round trips measured (mean + 4 deviations, as TCP's retransmission "
                          "timeout) and doubles after a micro-batch lost for want of time."),
        click.option("--pipeline-timeout-max", type=click.FloatRange(1, 600), default=600.0, show_default=True,
                     help="pipeline and forward-streamed runs, block 0: the most that budget may grow to "
                          "(equal to --pipeline-timeout: a fixed budget)."),
        click.option("--pipeline-weight-stash/--no-pipeline-weight-stash", default=False, show_default=True,
                     help="pipeline runs: when this block's weights changed between a micro-batch's forward and "
                          "its backward, run the backward on the weights the forward used (a copy is kept per "
                          "version still needed: weight stashing); --no-...: on the current weights."),
        click.option("--pipeline-flush", is_flag=True,
                     help="pipeline runs, holders of block 0: send --pipeline-inflight micro-batches together, "
                          "marked with their window, and wait for all of them before the next (GPipe); every "
                          "holder steps once per window (block 0 when it is done, the others when the next one "
                          "arrives, never while a backward is still due), so with one holder per block no "
                          "backward meets weights newer than its forward's, failed or retried calls included. "
                          "--pipeline-accumulate then applies only to micro-batches without a window."),
        click.option("--pipeline-recompute", is_flag=True,
                     help="pipeline runs, holders of every block but the last: keep only the input of a "
                          "micro-batch awaiting its gradient, not its graph, and run its forward again before "
                          "the backward (GPipe's re-materialisation: with several micro-batches in flight a "
                          "holder's activation memory is one graph's, for about a third more compute; the "
                          "gradients are the same, dropout masks included)."),
        click.option("--pipeline-layer-checkpoint", is_flag=True,
                     help="pipeline and forward-streamed runs: every forward that records a graph keeps only each "
                          "layer's input, and the backward runs each layer again (activation checkpointing): a "
                          "holder's activation memory is one layer's instead of its block's, for one more "
                          "forward of the block per micro-batch; the gradients are the same. Without "
                          "--pipeline-recompute a held micro-batch keeps its layers' inputs (one per layer) instead "
                          "of its graph, at the compute --pipeline-recompute alone costs."),
        click.option("--pipeline-loss-screen", type=click.FloatRange(0, 100), default=0.0, show_default=True,
                     metavar="NATS",
                     help="pipeline and forward-streamed runs, holders that compute a loss on micro-batches sent "
                          "to them (the last block; every block but 0 in forward-streamed runs): refuse to train "
                          "on one whose loss is more than NATS nats/byte above the median of the last 128 it "
                          "trained on (wider where those spread more; not before 32), answered 'outlier': "
                          "poisoned targets from a holder of the block before train nothing (RELIABILITY.md). "
                          "0: off."),
        click.option("--pipeline-check-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                     metavar="RATE",
                     help="pipeline runs, holders of every block but the last: before backpropagating a gradient "
                          "answered by a holder of the next block, recompute it from the states of the blocks on "
                          "its route (downloaded from those holders) for each holder's first answer and this share "
                          "of the others; a holder whose gradient disagrees is banned and the micro-batch dropped "
                          "(RELIABILITY.md: a Sybil answering negated gradients). 0: off."),
    ]
    for o in reversed(opts):
        wrapper = o(wrapper)
    return wrapper


@click.command("seed")
@click.option("--run-id", required=True, help="Name of the new run (letters, digits, '_' or '-').")
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR",
              help="Start the run on an existing DHT (any of its nodes); default: a new network.")
@click.option("--data", default="auto", show_default=True,
              help="What the run trains on: wikitext-2 / wikitext-103 (members fetch it by name), a local file "
                   "or folder (the manifest then carries only its sha256: members bring a copy with --data), "
                   "or 'auto' = shared WikiText-2 if present, else HF wikitext-2, else the Python stdlib's text.")
@click.option("--manifest-ttl", type=click.FloatRange(10, 30 * 86400), default=86400.0, show_default=True,
              help="Seconds each store of the run's manifest lives in the DHT. This node re-stores it every "
                   "quarter of that (at most every 10 minutes) while it runs, and every member keeps copies "
                   "signed by this node's key, so the run stays joinable after the seeder leaves while any "
                   "member runs.")
@config_options(default_objective=NEW_RUN_OBJECTIVE)
@node_options
@private_run_options
@pipeline_options
@friendly
def seed(run_id, initial_peers, data, manifest_ttl, config_path, objective, overrides, checkpoint_dir, block,
         ready_file, quiet, **node_kw):
    """Start the first node of a NEW run: publish its manifest, hold a block, print the address.

    \b
    Example:
      bt-node seed --run-id demo --config run.toml --port 31337 --http-port 8000
    """
    cfg = build_config(config_path, objective, overrides, default_objective=NEW_RUN_OBJECTIVE)
    from ..p2p.addresses import parse_initial_peers
    opts = _common(checkpoint_dir, run_id, config=cfg, data=data, manifest_ttl=manifest_ttl,
                   initial_peers=parse_initial_peers(list(initial_peers)), block=0 if block is None else block,
                   **node_kw)
    _run_node(opts, ready_file, quiet, "Seeded")


@click.command("join")
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR",
              help="Multiaddr of any node of the run (repeatable; optional with a RUN@MULTIADDR run address).")
@click.option("--run", "--run-id", "run_id", default=None, metavar="RUN", callback=lambda c, p, v: _run_address(v),
              help=RUN_HELP)
@click.option("--data", default=None,
              help="Train on this local data (a file or folder). Without it the node trains on the dataset the "
                   "run names; it never reads a path named by the network.")
@node_options
@private_run_options
@pipeline_options
@friendly
def join(initial_peers, run_id, data, checkpoint_dir, block, ready_file, quiet, **node_kw):
    """Join a run: pick the least-held block, download its current state, train, average and serve.

    A member nobody can dial (behind NAT) notices at join (its initial peers try to dial it back),
    trains and averages all the same, and serves its block through a relay on one of its initial
    peers once libp2p holds one (seconds after it starts); until then, or if none of them can
    relay, it says "training only" and routers skip it.

    \b
    Examples:
      bt-node join --run demo@/ip4/1.2.3.4/tcp/31337/p2p/QmSeeder...
      bt-node join --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/QmAnyNode...
    """
    peers = _peers(initial_peers, run_id)
    opts = _common(checkpoint_dir, run_id.run_id, seeder=run_id.seeder, initial_peers=peers, data=data, block=block,
                   **node_kw)
    _run_node(opts, ready_file, quiet, "Joined")


def where_options(fn):
    fn = click.option("--run", "--run-id", "run_id", default=None, metavar="RUN",
                      callback=lambda c, p, v: _run_address(v), help=RUN_HELP)(fn)
    fn = click.option("--http", "http_url", default=None, help="Ask this node's HTTP API instead (URL).")(fn)
    fn = click.option("--initial-peers", multiple=True, metavar="MULTIADDR", help="Any node of the run.")(fn)
    return fn


PEERS, HTTP = "--initial-peers MULTIADDR (or --run RUN@MULTIADDR)", "--http URL"


def _need_where(**where):
    """``where`` maps each option (as the error names it) to its value: exactly one must be given."""
    if sum(bool(v) for v in where.values()) != 1:
        names = list(where)
        raise click.UsageError(f"give exactly one of {', '.join(names[:-1])} or {names[-1]}")


def _network(initial_peers, address) -> bool:
    return bool(initial_peers) or bool(address is not None and address.bootstrap)


@click.command("generate")
@click.argument("prompt")
@where_options
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="Run every block on this machine, loaded from this directory (written by export or "
                   "train-local --out): no network.")
@click.option("--mode", type=click.Choice(["one_sweep", "autoregressive"]), default="one_sweep", show_default=True)
@click.option("--max-bytes", type=click.IntRange(1, 1024), default=None,
              help="Bytes to generate (default: min(64, the most the run can emit in the mode)).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def generate(prompt, initial_peers, http_url, run_id, checkpoint, mode, max_bytes, seed, temperature, as_json):
    """Generate text through the chain of blocks; prints the text and the route taken.

    \b
    Examples:
      bt-node generate "The history of" --http http://127.0.0.1:8000
      bt-node generate "The history of" --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...
      bt-node generate "The history of" --checkpoint runs/local
    """
    _need_where(**{"--checkpoint DIR": checkpoint, PEERS: _network(initial_peers, run_id), HTTP: http_url})
    if checkpoint:
        from ..blocks.model import load
        model = load(checkpoint)
        n = max_bytes or model.objective.generate_default(mode)
        res = model.generate(prompt.encode(), n, mode, seed=seed, temperature=temperature)
        res.pop("bytes")
        res["checkpoint"] = checkpoint
    elif http_url:
        body = {"prompt": prompt, "mode": mode, "seed": seed, "temperature": temperature}
        if max_bytes is not None:   # else the node's default for its run and this mode
            body["max_bytes"] = max_bytes
        from ..node.http import client as node_http
        res = node_http.generate(http_url, body)
    else:
        from ..node.client import NetworkClient
        c = NetworkClient(_peers(initial_peers, run_id), run_id)
        try:
            res = c.generate(prompt.encode(), max_bytes or c.objective.generate_default(mode), mode, seed=seed,
                             temperature=temperature)
            res.pop("bytes", None)
        finally:
            c.close()
    if as_json:
        emit_json(res)
        return
    click.echo(terminal_safe(prompt + res["text"]))   # what a model or a node sends may hold escape sequences
    route = " -> ".join(f"b{h['block']}@{plain(h['peer'][-8:])}" for h in res["route"])
    err_console.print(f"[dim]route: {route}; mode {plain(res['mode'])}; traversals {res['traversals']}[/]")


@click.command("status")
@where_options
@click.option("--json", "as_json", is_flag=True)
@friendly
def status(initial_peers, http_url, run_id, as_json):
    """Print a table of blocks x holders (state, step, throughput)."""
    _need_where(**{PEERS: _network(initial_peers, run_id), HTTP: http_url})
    if http_url:
        from ..node.http import client as node_http
        st = node_http.status(http_url)
        blocks, run = st["blocks"], st["run"]
    else:
        from ..node.client import NetworkClient
        c = NetworkClient(_peers(initial_peers, run_id), run_id)
        try:
            hs = c.holders()
            run = {"run_id": c.run_id, "config_hash": c.cfg.config_hash, "objective": c.cfg.objective,
                   "n_blocks": c.cfg.n_blocks}
            blocks = [{"block": b, "holders": [h.model_dump() for h in hs.get(b, [])]}
                      for b in range(c.cfg.n_blocks)]
        finally:
            c.close()
    if as_json:
        emit_json({"run": run, "blocks": blocks})
        return
    t = Table(title=f"run {plain(run['run_id'])} ({plain(run['objective'])}, config {plain(run['config_hash'])})")
    for col in ("block", "holder", "state", "step", "samples/s"):
        t.add_column(col)
    for blk in blocks:
        if not blk["holders"]:
            t.add_row(str(blk["block"]), "[red]none[/]", "", "", "")
        for h in blk["holders"]:
            t.add_row(str(blk["block"]), plain(h["peer_id"][-12:]), plain(h["state"]), str(h["step"]),
                      f"{h['throughput']:.1f}")
    err_console.print(t)
    missing = [b["block"] for b in blocks if not b["holders"]]
    click.echo(f"{len(blocks) - len(missing)}/{len(blocks)} blocks held" +
               (f"; no holder for {missing}" if missing else ""))


@click.command("export")
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR", help="Any node of the run.")
@click.option("--run", "--run-id", "run_id", default=None, metavar="RUN", callback=lambda c, p, v: _run_address(v),
              help=RUN_HELP)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def export(initial_peers, run_id, out, as_json):
    """Pull every block from the network into one directory (safetensors per block + config.json),
    which `bt-node eval --checkpoint DIR` and `bt-node generate --checkpoint DIR` accept."""
    from ..node.client import NetworkClient
    c = NetworkClient(_peers(initial_peers, run_id), run_id)
    try:
        res = c.export(out)
    finally:
        c.close()
    if as_json:
        emit_json(res)
    else:
        click.echo(f"exported {len(res['blocks'])} blocks of run {res['run_id']} to {res['out']}")
