"""bt-node bench simulate: the churn simulator (thin; logic in bench/sim/)."""
from __future__ import annotations

import click
from rich.table import Table

from blocktrain.node.routing.selection import RebalancePolicy

from .bench_net_cmds import _f, _record, _say
from .errors import friendly
from .render import emit_json, err_console


def simulate_table(res: dict) -> Table:
    first = next(iter(res["scenarios"].values()))["settings"]
    t = Table(title=f"bench simulate: {first['members']} members, {first['blocks']} blocks, "
                    f"{first['days']:g} simulated days after {first['warmup_h']:g} h warm-up, {res['seeds']} seed(s)")
    for col in ("churn", "policy", "coverage % (seeds' range)", f">= {100 * res['coverage_bar']:g}%", "emptied (mean s)",
                "online", "holders mean/min/p5", "avg. part.", "gen. ok %", "moves/member/day"):
        t.add_column(col, justify="left" if col in ("churn", "policy") else "right")
    for name, sc in res["scenarios"].items():
        for p, r in sc["runs"].items():
            by = r["coverage_by_seed"]
            cov = f" ({100 * min(by):.3f}-{100 * max(by):.3f})" if len(by) > 1 else ""
            t.add_row(name, p, f"{100 * r['coverage']:.3f}{cov}",
                      "met" if sc["bar_met"][p] else "MISSED",
                      f"{r['empty_episodes']} ({_f(r['empty_episode_mean_s'], '.0f')})", _f(r["online_mean"], ".0f"),
                      f"{r['holders_mean']:.2f} / {r['holders_min']} / {r['holders_p5']:g}",
                      _f(r["averaging_participation"], ".4f"), _f(100 * r["generation_success"], ".3f"),
                      _f(r["moves_per_member_day"], ".2f"))
    t.caption = ("; ".join(f"{n}: {sc['churn']}" for n, sc in res["scenarios"].items())
                 + f". Churn assumed; download median {first['download_median_s']:g} s, round window "
                   f"{first['round_window_s']:g} s, hop failure {first['hop_failure']:g}: the defaults are assumed, "
                   "BENCHMARKS.md gives measured values (the JSON's 'assumed').")
    return t


@click.command("simulate")
@click.option("--members", type=click.IntRange(1), default=1000, show_default=True, help="Volunteers in the population.")
@click.option("--days", type=click.FloatRange(0.01), default=3.0, show_default=True,
              help="Simulated days measured (after the warm-up).")
@click.option("--warmup-h", type=click.FloatRange(0), default=12.0, show_default=True,
              help="Simulated hours before measuring starts.")
@click.option("--blocks", type=click.IntRange(1, 1024), default=32, show_default=True, help="Blocks of the model.")
@click.option("--churn", "churns", multiple=True, type=click.Choice(["volunteer", "harsh", "custom"]),
              help="Churn preset(s), repeatable [default: volunteer and harsh]; 'custom': only the options below.")
@click.option("--join-rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Times per day an offline member comes back (exponential gaps) [preset].")
@click.option("--session-dist", type=click.Choice(["lognormal", "pareto", "none"]), default=None,
              help="Session length distribution; none = never leave [preset].")
@click.option("--session-median-h", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Median session length, hours [preset].")
@click.option("--session-sigma", type=click.FloatRange(0), default=None, help="Log-normal shape [preset].")
@click.option("--pareto-alpha", type=click.FloatRange(min=1, min_open=True), default=None, help="Pareto shape [1.5].")
@click.option("--download-median-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Median block download time, seconds (log-normal, sigma 0.8) [60].")
@click.option("--move-median-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Median time of a rebalancing move (state download only: no process start) [as a join].")
@click.option("--state-sources", type=click.IntRange(1, 16), default=None,
              help="States a join or a move downloads and judges (the node's --state-sources), at most the "
                   "block's ready holders [1].")
@click.option("--transfer-s", type=click.FloatRange(0), default=None,
              help="Seconds to carry one block state over a holder's uplink [0].")
@click.option("--parallel-states", type=click.IntRange(1, 16), default=None,
              help="States a member's downlink carries at once at a holder's uplink speed: a join or a move "
                   "takes --transfer-s x ceil(states / this) more [1].")
@click.option("--record-lag-s", type=click.FloatRange(0), default=None,
              help="Seconds before the others see a join's or a move's `joining` record (the DHT store); members "
                   "then check for moves at their own phase of the period, seeing only moves decided that long "
                   "before [0: at once]. Under the 10 s announcement period (TTL 30 s / 3).")
@click.option("--round-window-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Averaging round window (matchmaking + all-reduce), seconds [8].")
@click.option("--hop-failure", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="Probability that one hop try at a ready holder fails anyway [0].")
@click.option("--graceful", type=click.FloatRange(0, 1), default=None,
              help="Fraction of leaves that withdraw their announcement at once [0.5].")
@click.option("--policy", type=click.Choice(["both", "join-only", "rebalance"]), default="both", show_default=True,
              help="Least-held at join only, join + rebalancing, or both.")
@click.option("--min-surplus", type=click.IntRange(2), default=2, show_default=True, help="Rebalancing: surplus to move.")
@click.option("--min-keep", type=click.IntRange(1), default=2, show_default=True,
              help="Rebalancing: holders the old block keeps.")
@click.option("--min-dwell-s", type=click.FloatRange(0), default=600.0, show_default=True,
              help="Rebalancing: seconds on a block before leaving it.")
@click.option("--urgent-below", type=click.IntRange(0), default=2, show_default=True,
              help="Rebalancing: a block with fewer ready holders is urgent (moves to it skip the dwell); 0: off.")
@click.option("--urgent-inflight", type=click.IntRange(1), default=3, show_default=True,
              help="Rebalancing: an urgent block takes movers while fewer than this many are on their way.")
@click.option("--reserve-below", type=click.IntRange(0), default=RebalancePolicy.reserve_below, show_default=True,
              help="Rebalancing: a block with fewer ready holders (but not urgent) is short of a reserve; 0: off.")
@click.option("--reserve-inflight", type=click.IntRange(1), default=RebalancePolicy.reserve_inflight,
              show_default=True, help="Rebalancing: a short block takes movers while fewer than this many are on their way.")
@click.option("--seeds", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Seeds per setting (seed, seed+1, ...), figures averaged.")
@click.option("--seed", type=int, default=0, show_default=True, help="First seed.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Save coverage and holders per block over time as PNG here (needs matplotlib: the plots extra).")
@click.option("--record", type=click.Path(dir_okay=False), default=None, help="Append a dated JSON line here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_simulate_cmd(members, days, warmup_h, blocks, churns, join_rate, session_dist, session_median_h,
                       session_sigma, pareto_alpha, download_median_s, move_median_s, state_sources, transfer_s, parallel_states, record_lag_s, round_window_s, hop_failure, graceful, policy, min_surplus, min_keep,
                       min_dwell_s, urgent_below, urgent_inflight, reserve_below, reserve_inflight, seeds, seed, plot, record, as_json):
    """Simulate a volunteer network under churn: block coverage, averaging, generation, moves.

    \b
    A discrete-event simulation (no network, one CPU core, seconds per simulated day): members
    come and go with heavy-tailed sessions, take a block with the node's own choose_block,
    optionally rebalance with the node's own policy (node/routing/selection.py), download,
    announce with a TTL (crashed members' records linger), average in groups of up to 4 and serve
    generations with failover. Churn and timings are assumptions, printed with the table;
    --download-median-s, --round-window-s and --hop-failure take measured values (BENCHMARKS.md).
    Example:
      bt-node bench simulate --seeds 5 --plot docs/simulation_coverage.png
    """
    from blocktrain.bench.sim import SimSettings, plot_simulation, run_simulation
    from blocktrain.bench.sim.report import episode_causes

    base = SimSettings(members=members, days=days, warmup_h=warmup_h, blocks=blocks, seed=seed,
                       policy=RebalancePolicy(min_surplus=min_surplus, min_keep=min_keep, min_dwell_s=min_dwell_s,
                                              urgent_below=urgent_below, urgent_inflight=urgent_inflight,
                                              reserve_below=reserve_below, reserve_inflight=reserve_inflight))
    named = {"join_rate_per_day": join_rate, "session_dist": session_dist, "session_median_h": session_median_h,
             "session_sigma": session_sigma, "pareto_alpha": pareto_alpha, "download_median_s": download_median_s,
             "move_median_s": move_median_s, "state_sources": state_sources, "transfer_s": transfer_s,
             "parallel_states": parallel_states, "record_lag_s": record_lag_s,
             "round_window_s": round_window_s, "hop_failure": hop_failure,
             "graceful_fraction": graceful}
    overrides = {k: v for k, v in named.items() if v is not None}
    churns = list(dict.fromkeys(churns)) or ["volunteer", "harsh"]
    policies = {"both": None, "join-only": ["join-only"], "rebalance": ["join+rebalance"]}[policy]
    res = run_simulation(base, [None if c == "custom" else c for c in churns], policies, seeds=seeds,
                         overrides=overrides, on_progress=_say(as_json))
    if plot:
        res["plot"] = str(plot_simulation(res, plot))
    _record(record, res)
    if as_json:
        emit_json(res)
    else:
        err_console.print(simulate_table(res))
        for name, sc in res["scenarios"].items():
            click.echo(f"{name}: every block held " + ", ".join(
                f"{100 * r['coverage']:.3f}% ({p})" for p, r in sc["runs"].items()) + " of simulated time")
            for p, r in sc["runs"].items():
                c = episode_causes(r["episodes"])
                if c["episodes"]:
                    click.echo(f"  {name}, {p}: {c['episodes']} empty episode(s); last ready holder: "
                               + ", ".join(f"{k} {v}" for k, v in c["last_holder"].items())
                               + f"; it had been alone {c['lone_s_median']:g} s (median); members downloading the "
                               "block when it emptied: " + ", ".join(f"{k}: {v}" for k, v in
                                                                      c["downloading_when_emptied"].items())
                               + f"; a crashed holder's record still counted as ready in {c['stale_record_hid_it']}")
