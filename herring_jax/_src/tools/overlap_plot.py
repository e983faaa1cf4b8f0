"""The timeline picture of `herring-jax train-bench --overlap`: per rank, the
training steps and, inside them, when each gradient bucket's reduction was
issued by XLA (thin) and ran on herring's threads (thick)."""

from __future__ import annotations

import glob
import json


def load(prefix: str) -> dict[int, list[dict]]:
    """rank -> events, from the PREFIX.rankR files the ranks wrote."""
    out = {}
    for path in sorted(glob.glob(prefix + ".rank*")):
        rank = int(path.rsplit(".rank", 1)[1])
        with open(path) as f:
            out[rank] = [json.loads(line) for line in f if line.strip()]
    return out


def plot(prefix: str, png_path: str, title: str, steps: int = 3,
         forward_ms: float | None = None) -> bool:
    """Draws the last `steps` steps of every rank (all-gathers in blue, the
    other reductions in orange; with `forward_ms`, a tick where each step's
    forward pass ends, as measured alone); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped, matplotlib is not installed (pip install matplotlib)")
        return False
    ranks = load(prefix)
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 1.6 + 1.1 * len(ranks)), squeeze=False)
    for ax, (rank, events) in zip(axes[:, 0], sorted(ranks.items())):
        stepped = [e for e in events if e["kind"] == "step"][-steps:]
        if not stepped:
            continue
        t0 = stepped[0]["start_ns"]
        t1 = stepped[-1]["end_ns"]
        for i, e in enumerate(stepped):
            ax.barh(1, (e["end_ns"] - e["start_ns"]) / 1e6, left=(e["start_ns"] - t0) / 1e6,
                    height=0.6, color="#c8d7ea" if i % 2 else "#a9c1e0", edgecolor="#4a6fa5")
        reds = [e for e in events if e["kind"] == "reduction" and t0 <= e["issued_ns"] <= t1]
        for j, e in enumerate(reds):
            y = 0.25 + 0.5 * (j % 2)
            ax.plot([(e["issued_ns"] - t0) / 1e6, (e["begun_ns"] - t0) / 1e6], [y, y],
                    color="#999999", lw=1)
            gather = e.get("what", "").startswith("all_gather")
            ax.barh(y, (e["ended_ns"] - e["begun_ns"]) / 1e6, left=(e["begun_ns"] - t0) / 1e6,
                    height=0.35, color="#3b7dd8" if gather else "#e07b39",
                    edgecolor="#1f4a8a" if gather else "#8a4a1f")
        if forward_ms is not None:
            for e in stepped:
                at = (e["start_ns"] - t0) / 1e6 + forward_ms
                ax.plot([at, at], [-0.05, 1.35], color="#2a2a2a", lw=1, ls="--")
        ax.set_yticks([0.5, 1])
        ax.set_yticklabels(["reductions", "steps"])
        ax.set_ylim(-0.1, 1.45)
        ax.set_title(f"rank {rank}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the first step shown")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True
