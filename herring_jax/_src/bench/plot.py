"""The PNG of `herring-jax bench --plot`: bandwidth per size and peer."""

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
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for peer in report["peers"]:
        rows = sorted((r["mib"], r["mib"] * 2**20 / r["median_s"] / 1e9)
                      for r in report["results"] if r["peer"] == peer)
        ax.plot([m for m, _ in rows], [bw for _, bw in rows], marker="o", label=peer,
                linewidth=2.5 if peer == "herring" else 1.5)
    bounds = {float(m): s for m, s in (report.get("bound_s") or {}).items() if s}
    if bounds:
        sizes = sorted(bounds)
        ax.plot(sizes, [m * 2**20 / bounds[m] / 1e9 for m in sizes], "k--",
                label=f"bound ({report.get('bound_formula', '')})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size, MiB (float32)")
    ax.set_ylabel("algorithmic bandwidth, GB/s (bytes / median time)")
    ax.set_title(textwrap.fill(f"all-reduce, {n} processes, {report.get('network', 'loopback')}",
                               95), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"plot: {png_path}")
