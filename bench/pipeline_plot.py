"""The figure of ``bt-node bench pipeline`` (matplotlib: the ``plots`` extra)."""
from __future__ import annotations

from pathlib import Path

REF_LINES = (("whole", "whole-size, end to end, equal tokens", "--"),
             ("one_block_cpu", "one block alone, CPU-s of one pipeline worker", "-."),
             ("one_block", "one block alone, same wall time, this shared machine", ":"))


def plot_pipeline(res: dict, path: str | Path) -> Path:
    """Bar panels, one bar per objective: chain CE (reference lines across), tokens/s, bytes per worker per
    step, serving latency (or peak memory); with a curve, CE against one worker's CPU-seconds beside them."""
    from blocktrain.bench.plots import figure, save
    plt = figure()
    names = list(res["runs"])
    refs = res.get("references") or {}
    panels = [("chain CE, nats/byte (held-out)", lambda r: r["chain_ce"]),
              ("tokens/s (slowest block)", lambda r: r["tokens_per_s"]),
              ("KB sent per worker per step", lambda r: (r["bytes_sent_per_worker_per_step"] or 0) / 1e3),
              (f"serving s, {res['settings']['gen_bytes']} bytes at {res['settings']['delay_ms']:g} ms/hop",
               lambda r: r["serving"]["latency_s"])]
    if not res["settings"].get("serving", True):   # not measured: the workers' peak memory instead
        panels[-1] = ("peak RSS per worker, MiB (max)", lambda r: r["peak_rss_mib_max"])
    curves = {n: [p for p in res["runs"][n].get("curve", []) if "ce" in p] for n in names}
    has_curve = any(curves.values())
    fig, axes = plt.subplots(1, 5 if has_curve else 4, figsize=(17.5 if has_curve else 14, 3.8))
    for ax, (title, get) in zip(axes, panels):
        ax.bar(names, [get(res["runs"][n]) for n in names], color=[f"C{i}" for i in range(len(names))])
        if ax is axes[0]:
            for key, label, style in REF_LINES:
                if key in refs:
                    ax.axhline(refs[key]["ce"], color="k", ls=style, lw=1, label=label)
            if refs:
                ax.legend(fontsize=6, loc="lower right")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    if has_curve:
        ax = axes[4]
        for i, n in enumerate(names):
            if curves[n]:
                ax.plot([p["cpu_s"] for p in curves[n]], [p["ce"] for p in curves[n]], "o-", color=f"C{i}", label=n)
        ref_curve = (refs.get("one_block_cpu") or {}).get("curve") or []
        if ref_curve:
            ax.plot([p["cpu_s"] for p in ref_curve], [p["ce"] for p in ref_curve], "k-.", marker="s", ms=3,
                    label="one block alone")
        ax.set_xlabel("CPU-seconds of one worker (mean)", fontsize=8)
        n_w = min(res["settings"]["curve_windows"], res["settings"]["eval_windows"])
        ax.set_title(f"held-out CE along the way ({n_w} windows)", fontsize=9)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    s = res["settings"]
    fig.suptitle(f"bench pipeline: {len(s['plan'])} workers (blocks {s['plan']}), {s['train_s']:g}s of training each, "
                 f"protocol {res['protocol']}", fontsize=9)
    return save(plt, fig, path)
