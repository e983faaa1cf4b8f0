"""Draws local_sgd.png for docs/guides/local_sgd.md: the held-out loss of
each run of a `herring-jax train-bench --codecs ... --json` file against the
wall-clock time (logged step + 1, times the run's median step) and against
the steps.

  python docs/guides/plot_local_sgd.py RUN.json [RUN2.json ...] -o docs/guides/local_sgd.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="train-bench --codecs JSON files")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    fig, axes = plt.subplots(len(args.runs), 2, figsize=(11, 4 * len(args.runs)), squeeze=False)
    for row, path in zip(axes, args.runs):
        with open(path) as f:
            data = json.load(f)
        for r in data["results"]:
            steps = [s + 1 for s, _ in r["held_out_curve"]]
            losses = [loss for _, loss in r["held_out_curve"]]
            seconds = [s * r["median_step_ms"] / 1e3 for s in steps]
            label = "allreduce_gradients" if r["codec"] == "none" else r["codec"]
            row[0].plot(seconds, losses, marker=".", label=label)
            row[1].plot(steps, losses, marker=".", label=label)
        where = f"{data['processes']} processes, {data['launch_args']}"
        row[0].set(xlabel="seconds (median step x steps)", ylabel="held-out loss",
                   title=f"against time: {where}")
        row[1].set(xlabel="steps", ylabel="held-out loss", title="against steps")
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=80)


if __name__ == "__main__":
    main()
