"""Draws the benchmark figures that the runs did not draw themselves, from the
JSON those runs wrote (all in this folder):

  python3 -P docs/benchmarks/plot_figures.py
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from herring_jax._src.tools.bench.plot import plot  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def training(json_name: str, png_name: str, title: str) -> None:
    """Median step per reducer on 1 and on N processes (train-bench's JSON)."""
    with open(os.path.join(HERE, json_name)) as f:
        data = json.load(f)
    reducers = list(dict.fromkeys(r["reduce"] for r in data["results"]))
    counts = data["processes"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(counts)
    for k, n in enumerate(counts):
        steps = [next(r["median_step_ms"] for r in data["results"]
                      if r["reduce"] == red and r["processes"] == n) for red in reducers]
        bars = ax.bar([i + k * width for i in range(len(reducers))], steps, width,
                      label=f"{n} process{'es' if n > 1 else ''}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + width * (len(counts) - 1) / 2 for i in range(len(reducers))])
    ax.set_xticklabels(reducers)
    ax.set_ylabel("median step, ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, png_name), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    plot(os.path.join(HERE, "codecs_netns4_evening.json"),
         os.path.join(HERE, "codecs_netns4_evening.png"))
    plot(os.path.join(HERE, "scale_netns_16.json"), os.path.join(HERE, "scale_netns_16.png"))
    training("train_netns.json", "train_netns.png",
             "examples/train_lm.py, 4 simulated hosts (1 Gbit/s hosts, 250 Mbit/s flows)")
    training("train_loopback.json", "train_loopback.png", "examples/train_lm.py, one host")
