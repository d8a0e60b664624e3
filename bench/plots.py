"""The plots of the network benchmarks (matplotlib, the optional ``plots`` extra, imported lazily).

Each function takes the JSON result its benchmark returns and writes one PNG."""
from __future__ import annotations

from pathlib import Path


def figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_swarm(res: dict, path: str | Path) -> Path:
    """CE vs wall time and CE vs bytes moved, one line per run."""
    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"baseline": "black", "avg-fp32": "C0", "avg-fp16": "C1", "avg-8bit": "C2"}
    for name, r in res["runs"].items():
        c = r["curve"]
        kw = dict(marker="o", ms=3, label=name, color=colors.get(name))
        a.plot([p["t"] for p in c], [p["ce"] for p in c], **kw)
        if r["averaging"]:
            b.plot([p["bytes_sent"] / 1e6 for p in c], [p["ce"] for p in c], **kw)
    b.axhline(res["runs"]["baseline"]["curve"][-1]["ce"], color="black", ls="--", lw=1,
              label="baseline at the same steps (0 bytes)")
    a.set_xlabel("wall time since the first worker started (s)")
    b.set_xlabel("averaging bytes sent, all workers (MB)")
    for ax in (a, b):
        ax.set_ylabel("chain CE, nats/byte (held-out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = res["settings"]
    fig.suptitle(f"bench swarm: {s['max_steps']} steps per worker, protocol {res['protocol']} (curve: "
                 f"{s['curve_windows']} held-out windows; each averaged run's last point is after its final "
                 f"explicit round)", fontsize=9)
    return save(plt, fig, path)


def plot_inference(res: dict, path: str | Path) -> Path:
    """Wall time per generation vs output length, one-sweep vs autoregressive (log scale)."""
    plt = figure()
    rows = res["lengths"]
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("autoregressive", "autoregressive (1 traversal per byte)"),
                        ("one_sweep", "one-sweep (1 traversal per output)")):
        ax.plot(ns, [r[mode]["wall_s"] for r in rows], marker="o", label=label)
        ax.plot(ns, [r["injected_delay_floor_s"][mode] for r in rows], ls=":", color="gray", lw=1)
    for r in rows:
        ax.annotate(f"{r['speedup']:.0f}x", (r["n"], r["one_sweep"]["wall_s"]), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("output bytes")
    ax.set_ylabel("wall time per generation (s)")
    ax.set_title(f"{res['hops']} hops, {res['delay_ms']:g} ms one-way per hop (dotted: injected delay alone)",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(plt, fig, path)
