"""The PNG of `herring-jax bench --plot`: bandwidth per size and peer, one
panel per collective."""

from __future__ import annotations

import json
import textwrap


def plot(json_path: str, png_path: str) -> None:
    """Algorithmic bandwidth per size, one line per peer, and the bound."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped, matplotlib is not installed (pip install matplotlib)")
        return
    with open(json_path) as f:
        report = json.load(f)
    n = report["n"]
    # Reports written before --collective hold all-reduces only.
    collectives = report.get("collectives", ["allreduce"])
    bounds_s = report.get("bounds_s") or {"allreduce": report.get("bound_s") or {}}
    formulas = report.get("bound_formulas") or {"allreduce": report.get("bound_formula", "")}
    fig, axes = plt.subplots(1, len(collectives), figsize=(7 * len(collectives), 4.5),
                             squeeze=False)
    for ax, collective in zip(axes[0], collectives):
        for i, peer in enumerate(report["peers"]):
            rows = sorted((r["mib"], r["mib"] * 2**20 / r["median_s"] / 1e9)
                          for r in report["results"] if r["peer"] == peer
                          and r.get("collective", "allreduce") == collective)
            if rows:
                # One colour per peer in every panel, also where a peer is absent.
                ax.plot([m for m, _ in rows], [bw for _, bw in rows], marker="o", label=peer,
                        color=f"C{i % 10}", linewidth=2.5 if peer == "herring" else 1.5)
        bounds = {float(m): s for m, s in (bounds_s.get(collective) or {}).items() if s}
        if bounds:
            sizes = sorted(bounds)
            ax.plot(sizes, [m * 2**20 / bounds[m] / 1e9 for m in sizes], "k--", marker="x",
                    label=f"bound ({formulas.get(collective, '')})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer size S, MiB (float32)")
        ax.set_ylabel("algorithmic bandwidth, GB/s (S / median time)")
        ax.set_title(textwrap.fill(f"{collective.replace('_', '-')}, {n} processes, "
                                   f"{report.get('network', 'loopback')}", 95), fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"plot: {png_path}")
