"""Draws a merged HERRING_TIMELINE trace the way Perfetto lays it out (one
band per process, one row per "thread", each reduction a bar with its wait
for a herring thread as a thin line before it), for the timeline page's
figure:

  HERRING_TIMELINE=/tmp/t/trace.json herring-jax launch -n 4 -- \
      python examples/demo_train.py --steps 60 --plot ''
  herring-jax timeline /tmp/t/trace.rank*.json -o /tmp/t/merged.json
  python docs/guides/draw_trace.py /tmp/t/merged.json docs/guides/timeline.png
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from herring_jax._src.process import timeline  # noqa: E402


def main(trace: str, png: str, last_ms: float = 40.0) -> None:
    events = timeline.load(trace)
    reductions = [e for e in events if e.get("ph") == "X" and "args" in e]
    # The last steps of the training loop: the window before the final checks.
    steps = [e for e in reductions if "float32[] " in e["name"]]
    end = max(e["ts"] + e["dur"] for e in steps)
    start = end - last_ms * 1e3
    rows = sorted({(e["pid"], e["tid"]) for e in reductions})
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("name") == "thread_name"}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.4))
    colors = {"gradients": "#e07b39", "loss": "#4a6fa5", "other": "#8aa05a"}
    for y, row in enumerate(rows):
        for e in reductions:
            if (e["pid"], e["tid"]) != row or not start <= e["ts"] <= end:
                continue
            kind = ("loss" if "float32[] " in e["name"] else
                    "gradients" if e["name"].startswith("mean float32[") else "other")
            t0 = (e["ts"] - start) / 1e3
            wait = e["args"]["waited_for_thread_us"] / 1e3
            ax.plot([t0, t0 + wait], [y, y], color="#777777", lw=1)
            ax.barh(y, e["dur"] / 1e3 - wait, left=t0 + wait, height=0.6, color=colors[kind])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms (the last steps of examples/demo_train.py on 4 processes)", labelpad=22)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["gradient buckets (mean float32[...])", "the step's loss (mean float32[])",
                        "other"], fontsize=8, loc="upper left",
              bbox_to_anchor=(0, -0.09), ncol=3, frameon=False)
    ax.set_title("HERRING_TIMELINE: each process's reductions (grey: waiting for a herring thread)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
