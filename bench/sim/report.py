"""Figures of a simulation, the join-only vs join+rebalancing comparison, and its plot."""
from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from .engine import Simulation
from .model import ASSUMED, CHURN_PRESETS, DAY, HOUR, SimSettings

POLICIES = {"join-only": False, "join+rebalance": True}
COVERAGE_BAR = 0.999        # issue 15: every block has a live holder >= 99.9% of simulated time


def summarize(sim: Simulation) -> dict:
    s = sim.s
    measured = s.days * DAY
    h = np.asarray(sim.samples, dtype=float) if sim.samples else np.zeros((1, s.blocks))
    ep = sim.episode_s
    bins = sim.bin_uncovered
    per = s.bin_s
    hours = len(bins) * per / HOUR
    return {
        "coverage": 1.0 - sim.uncovered_s / measured,
        "block_uncovered_fraction": sim.block_uncovered_s / (measured * s.blocks),
        "empty_episodes": sim.episodes,
        "empty_episode_mean_s": float(np.mean(ep)) if ep else None,
        "holders_mean": float(h.mean()),
        "holders_min": int(h.min()),
        "holders_p5": float(np.percentile(h, 5)),
        "online_mean": float(np.mean(sim.online_n)) if sim.online_n else 0.0,
        "averaging_participation": sim.round_ok / sim.round_ready if sim.round_ready else None,
        "groups_failed_by_a_departure": sim.rounds_failed_leave,
        "generation_success": float(np.mean(sim.gen_ok)) if sim.gen_ok else None,
        "generation_fail_no_holder": sim.gen_uncovered / len(sim.gen_ok) if sim.gen_ok else None,
        "moves": sim.moves,
        "moves_per_member_day": sim.moves / (s.members * s.days),
        "urgent_moves": sim.urgent_moves,
        "reserve_moves": sim.reserve_moves,
        "moves_abandoned": sim.abandoned,
        "episodes": sim.episode_log,
        "joins": sim.joins,
        "timeline": {
            "hour": [round(per * (i + 0.5) / HOUR, 4) for i in range(len(bins))],
            "covered": [round(1.0 - u / per, 5) for u in bins],
            "holders_min": _per_bin(sim, h, np.min, len(bins)),
            "holders_mean": _per_bin(sim, h, np.mean, len(bins)),
        },
        "hours": hours,
    }


def _per_bin(sim: Simulation, h: np.ndarray, f, nbins: int) -> list:
    if not sim.sample_t:
        return [None] * nbins
    idx = ((np.asarray(sim.sample_t) - sim.t0) // sim.s.bin_s).astype(int).clip(0, nbins - 1)
    out = []
    for i in range(nbins):
        rows = h[idx == i]
        out.append(round(float(f(rows)), 3) if len(rows) else None)
    return out


def simulate(s: SimSettings) -> dict:
    t = time.perf_counter()
    out = summarize(Simulation(s).run())
    out["wall_s"] = round(time.perf_counter() - t, 2)
    return out


def settings_dict(s: SimSettings) -> dict:
    d = asdict(s)
    d.pop("check_view")
    d["policy"] = asdict(s.policy)
    return d


def pool(runs: list[dict]) -> dict:
    """Several seeds of one setting: means of the figures (holders_min: the least; counts: totals),
    each seed's coverage, and the first seed's timeline."""
    out = dict(runs[0])
    if len(runs) == 1:
        out["coverage_by_seed"] = [runs[0]["coverage"]]
        return out
    for k, v in runs[0].items():
        vals = [r[k] for r in runs]
        if k == "holders_min":
            out[k] = min(vals)
        elif k in ("empty_episodes", "moves", "urgent_moves", "reserve_moves", "moves_abandoned", "joins", "groups_failed_by_a_departure",
                   "wall_s"):
            out[k] = sum(vals)
        elif k == "episodes":
            out[k] = [dict(e, seed=i) for i, r in enumerate(runs) for e in r[k]]
        elif k == "empty_episode_mean_s":
            eps = [(r[k], r["empty_episodes"]) for r in runs if r[k] is not None]
            out[k] = sum(m * n for m, n in eps) / sum(n for _, n in eps) if eps else None
        elif isinstance(v, float):
            out[k] = sum(vals) / len(vals)
    out["coverage_by_seed"] = [r["coverage"] for r in runs]
    return out


def episode_causes(episodes: list[dict]) -> dict:
    """What led to the empty episodes (:meth:`Simulation.record_episode`): how the last ready holder
    went, how long it had been the only one, how many members were downloading the block meanwhile."""
    if not episodes:
        return {"episodes": 0}
    lone = sorted(e["lone_s"] for e in episodes)
    inflight: dict[str, int] = {}
    causes: dict[str, int] = {}
    for e in episodes:
        k = str(min(e["inflight"], 3)) + ("+" if e["inflight"] >= 3 else "")
        inflight[k] = inflight.get(k, 0) + 1
        causes[e["cause"]] = causes.get(e["cause"], 0) + 1
    return {"episodes": len(episodes), "last_holder": causes, "downloading_when_emptied": dict(sorted(inflight.items())),
            "lone_s_median": lone[len(lone) // 2],
            "stale_record_hid_it": sum(e["announced_ready"] >= 2 for e in episodes)}


def run_simulation(base: SimSettings, churns: list[str] | None = None, policies: list[str] | None = None,
                   seeds: int = 1, overrides: dict | None = None, on_progress=None) -> dict:
    """Both policies (or the ones asked) under each churn (a preset name, or None: ``base`` as given),
    each over ``seeds`` seeds (base.seed, base.seed + 1, ...; the same ones for every policy).
    ``overrides``: settings applied on top of every preset."""
    policies = policies or list(POLICIES)
    res = {"bench": "simulate", "scenarios": {}, "assumed": ASSUMED, "coverage_bar": COVERAGE_BAR, "seeds": seeds}
    for churn in churns or [None]:
        s = replace(base.with_churn(churn) if churn else base, **(overrides or {}))
        s.validate()
        runs = {}
        for p in policies:
            if on_progress:
                on_progress(f"{churn or 'custom'} churn, {p}: {s.members} members x {s.days:g} days x {seeds} seed(s)")
            runs[p] = pool([simulate(replace(s, rebalance=POLICIES[p], seed=s.seed + i)) for i in range(seeds)])
        res["scenarios"][churn or "custom"] = {
            "churn": s.describe_churn(), "settings": settings_dict(s), "runs": runs,
            "bar_met": {p: r["coverage"] >= COVERAGE_BAR for p, r in runs.items()},
        }
    return res


def plot_simulation(res: dict, path: str | Path) -> Path:
    """Per churn setting (a column): coverage per hour, and the fewest ready holders of any block per
    hour, both policies (the first seed); the mean holders per block, the same for both, in grey."""
    import textwrap

    from blocktrain.bench.plots import figure, save
    plt = figure()
    sc = res["scenarios"]
    fig, axes = plt.subplots(2, len(sc), figsize=(6.2 * len(sc), 6.8), squeeze=False, sharex="col")
    colors = {"join-only": "C3", "join+rebalance": "C0"}
    for j, (name, scen) in enumerate(sc.items()):
        a, b = axes[0][j], axes[1][j]
        s = scen["settings"]
        for p, r in scen["runs"].items():
            tl = r["timeline"]
            a.plot(tl["hour"], [100 * c for c in tl["covered"]], color=colors.get(p), lw=1, drawstyle="steps-mid",
                   label=f"{p}: {100 * r['coverage_by_seed'][0]:.3f}% of the time")
            b.plot(tl["hour"], tl["holders_min"], color=colors.get(p), lw=1, drawstyle="steps-mid",
                   label=f"{p}: fewest holders of any block")
        b.plot(tl["hour"], tl["holders_mean"], color="grey", lw=1, ls="--", label="mean holders per block")
        a.set_title(textwrap.fill(f"{name}: {s['members']} members, {s['blocks']} blocks, seed {s['seed']}; "
                                  f"{scen['churn']}", 70), fontsize=8)
        a.set_ylabel(f"% of each {s['bin_s'] / 60:.0f} min with every block held")
        b.set_ylabel("ready holders (min over the bin)")
        b.set_xlabel("simulated hours (after the warm-up)")
        b.set_ylim(bottom=0)
        for ax in (a, b):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    s0 = next(iter(sc.values()))["settings"]
    fig.suptitle("bt-node bench simulate: block coverage under churn, join-only vs join + rebalancing "
                 f"(churn assumed; download median {s0['download_median_s']:g} s, round window "
                 f"{s0['round_window_s']:g} s, hop failure {s0['hop_failure']:g})", fontsize=9)
    return save(plt, fig, path)


__all__ = ["run_simulation", "simulate", "summarize", "pool", "episode_causes", "plot_simulation", "POLICIES", "COVERAGE_BAR",
           "CHURN_PRESETS", "SimSettings"]
