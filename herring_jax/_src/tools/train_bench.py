"""herring-jax train-bench: step time and scaling efficiency of a training job.

  herring-jax train-bench -n 4 [--steps 60] [--script examples/train_lm.py] [--json out.json]

Runs the data-parallel training example (examples/train_lm.py by default) under
`herring-jax launch` on 1 and on N processes, once per reducer:
  herring  gradients averaged by herring_jax.allreduce_gradients
  native   gradients averaged by jax.lax.pmean (jax's gloo CPU collectives)
  none     no averaging: every process trains alone (compute only)
and prints each run's median step time with two efficiencies:
  scaling  = step(1 process) / step(N processes), weak scaling (the batch per
             device is fixed, so N processes do N times the work per step);
  comm     = step(none, N) / step(reducer, N): the share of the N-process step
             not lost to gradient reduction. Where the processes share fewer
             cores than they need (this project's 2-core CI machine), compute
             alone cannot scale and `comm` is the figure to read.

With --simulated-accelerator it runs herring_jax/_src/tools/simulated_worker.py on 1
and on N processes: layers whose compute is a wait that uses no CPU (as a GPU
host's CPU sees it) with real gradients of a BERT-like layer structure, and
prints the scaling efficiency step(1) / step(N) next to its bound.

With --codecs none,bf16,int8,powersgd4,sharded it instead trains on N processes once
per wire codec of allreduce_gradients(compression=...) (powersgd<r>:
herring_jax.powersgd of rank r instead, powersgd<r>-<codec> with its factors
in that wire codec, ...-it<k> with k power iterations, e.g. powersgd4-bf16-it2;
topk<f>: herring_jax.topk sending the share f of each leaf, e.g. topk0.01;
sharded[-<codec>]: herring_jax.sharded_optimizer(optimizer) in place of
allreduce_gradients + optimizer; fully[-reshard][-<codec>]:
herring_jax.fully_sharded(optimizer), with reshard_after_forward) for the same
steps and prints, for each, the held-out loss (and its distance from the
uncompressed run's), the median and mean step, the bytes each process's transport sent
per step, the optimizer state each process holds, the parameters and
optimizer state it holds between steps (held) and the compiled step's
temporary buffers (temp, from XLA's memory_analysis); --plot draws the
held-out loss against the steps.
Names for the optimizers that sync every H steps: localsgd<H>, slowmo<H>,
diloco<H>[f<F>][d<D>][-<codec>] (herring_jax.local_sgd and its presets, the
script's --local-steps H --outer ... [--fragments F] [--delay D]; e.g.
diloco16-int8, diloco16f4d2-int8: streaming), and compute (no reduction at
all: each process trains alone, the compute-only step). With none in the list
it also prints the time each run took to reach none's final held-out loss.
With --seeds 0,1,2 every codec trains once per seed (the model's
initialization and the batches) and the table gives the mean held-out loss
and bytes (the median of the median steps), the distance from none as the
mean of the per-seed distances, and those distances one by one: on
examples/train_lm.py PowerSGD's distance moves by more than two points from
seed to seed. On one host (no --netns in --launch-args) it sets
HERRING_HOST_STAGE=0, since a codec applies only to what crosses the
transport.

With --overlap it instead runs herring_jax/_src/tools/overlap_worker.py on N
processes: compute alone, reduction alone and the standard step of an MLP,
the hidden fraction, a bitwise check against the reduction done outside the
step, and (--plot) a timeline PNG of the last steps on every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from herring_jax._src.tools.codec_names import codec_args as _codec_args

REDUCERS = ("herring", "native", "none")
_DONE = re.compile(r"done: reduce=(\w+) processes=(\d+) final loss ([\d.]+).*median step "
                   r"([\d.]+) ms")
# Rank 0's bytes sent per step: shows whether server-only processes took the traffic.
_SENT = re.compile(r"sent ([\d.]+) MiB per step")


def default_script() -> str:
    """examples/train_lm.py: in the installed package, where pyproject.toml
    ships examples/ (herring_jax/examples), else in the source tree."""
    import herring_jax
    package = os.path.dirname(os.path.abspath(herring_jax.__file__))
    shipped = os.path.join(package, "examples", "train_lm.py")
    source = os.path.join(os.path.dirname(package), "examples", "train_lm.py")
    return source if not os.path.isfile(shipped) and os.path.isfile(source) else shipped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `herring-jax train-bench`."""
    # --help shows the modes this module's docstring describes after the options.
    parser.epilog = __doc__.split("\n", 2)[2]
    parser.add_argument("-n", "--num-processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--reducers", default=",".join(REDUCERS),
                        help=f"comma-separated subset of {', '.join(REDUCERS)}")
    parser.add_argument("--script", default=default_script(),
                        help="training script (takes --reduce, --steps, --log-every)")
    parser.add_argument("--launch-args", default="",
                        help="extra options for herring-jax launch, e.g. '--netns --servers 4'")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--codecs", default=None, metavar="LIST",
                        help="compare the held-out loss of wire codecs (see below)")
    parser.add_argument("--log-every", type=int, default=10,
                        help="--codecs: steps between held-out losses")
    parser.add_argument("--seeds", default=None, metavar="LIST",
                        help="--codecs: train every codec once per seed (comma-separated "
                             "integers, passed as the script's --seed) and average")
    parser.add_argument("--overlap", action="store_true",
                        help="measure how much reduction the training step hides (see below)")
    parser.add_argument("--plot", default=None,
                        help="--overlap: timeline PNG to write; --codecs: held-out loss PNG")
    parser.add_argument("--simulated-accelerator", action="store_true",
                        help="scaling of simulated-accelerator training (see below)")
    parser.add_argument("--xla-flags", default=None, metavar="FLAGS",
                        help="XLA_FLAGS for every run (default: none; the caller's XLA_FLAGS "
                             "are dropped, so that a forced device count does not change "
                             "the layout), e.g. --xla-flags=--xla_backend_optimization_level=0 "
                             "to compile faster and step slower")
    parser.add_argument("script_args", nargs="*",
                        help="extra options for the script or, with --overlap, the overlap "
                             "worker (--layers, --width, --batch, --steps, --pin, ...)")


def _run_env(args) -> dict:
    """The environment of every run: the caller's without its XLA_FLAGS, and
    --xla-flags' in their place."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if getattr(args, "xla_flags", None):
        env["XLA_FLAGS"] = args.xla_flags
    return env


def _run_script(args, n: int, script_args: list[str], env: dict | None = None):
    """The training script on n processes under herring-jax launch, with
    `script_args` before the user's; the finished process."""
    script = os.path.abspath(args.script)
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", str(n), "--timeout",
           str(int(args.timeout)), *args.launch_args.split(), "--", sys.executable, script,
           *script_args, *args.script_args]
    if env is None:
        env = _run_env(args)
    return subprocess.run(cmd, cwd=os.path.dirname(script), env=env, capture_output=True,
                          text=True, timeout=args.timeout + 60, check=False)


def _run_one(args, n: int, reducer: str) -> dict:
    proc = _run_script(args, n, ["--reduce", reducer, "--steps", str(args.steps),
                                 "--log-every", str(args.steps)])
    m = _DONE.search(proc.stdout)
    if proc.returncode != 0 or m is None:
        tail = (proc.stdout[-2000:] + proc.stderr[-2000:]).strip()
        raise RuntimeError(f"{reducer} on {n} processes failed (exit {proc.returncode}):\n{tail}")
    sent = float(s.group(1)) if (s := _SENT.search(proc.stdout)) else float("nan")
    return {"reduce": reducer, "processes": n, "final_loss": float(m.group(3)),
            "median_step_ms": float(m.group(4)), "sent_mib_per_step": sent}


_STEP = re.compile(r"step +(\d+) +loss \S+ +step \S+ ms +held-out loss ([\d.naif]+)")
_CODEC_DONE = re.compile(r"held-out loss ([\d.naif]+), median step ([\d.]+) ms, compression "
                         r"(\S+), sent ([\d.]+) MiB per step(?:, optimizer state ([\d.]+) MiB "
                         r"per process)?")
# Memory per process (data_parallel.py's done line): held between steps, and temporaries.
_HELD = re.compile(r"params and optimizer state held ([\d.]+) MiB per process")
_TEMP = re.compile(r"temporaries ([\d.]+) MiB")
_MEAN = re.compile(r"mean step ([\d.]+) ms")


def _print_time_to_loss(results: list[dict], base: dict) -> None:
    """For each run, the first logged step whose held-out loss (mean over the
    seeds) is at most none's final one, and that step's time at the run's
    median step (step + 1 steps); stored as time_to_none_loss_s (None: never)."""
    target = base["held_out_loss"]
    for r in results:
        reached = next((s for s, loss in r["held_out_curve"] if loss <= target), None)
        r["time_to_none_loss_s"] = (None if reached is None
                                    else (reached + 1) * r["median_step_ms"] / 1e3)
    print(f"time to none's final held-out loss {target:.4f} (median step x steps):")
    for r in results:
        if r["time_to_none_loss_s"] is None:
            print(f"  {r['codec']}: not reached in {r['held_out_curve'][-1][0] + 1} steps")
            continue
        ratio = (base["time_to_none_loss_s"] or float("nan")) / r["time_to_none_loss_s"]
        print(f"  {r['codec']}: {r['time_to_none_loss_s']:.2f} s, {ratio:.2f}x as fast as none")


def _run_codec(args, codec: str, env: dict, seed: int | None) -> dict:
    seeded = [] if seed is None else ["--seed", str(seed)]
    how, name = _codec_args(codec)
    proc = _run_script(args, args.num_processes,
                       ["--reduce", "herring", *how, *seeded, "--steps", str(args.steps),
                        "--log-every", str(args.log_every)], env)
    done = _CODEC_DONE.search(proc.stdout)
    if proc.returncode != 0 or done is None:
        tail = (proc.stdout[-2000:] + proc.stderr[-2000:]).strip()
        raise RuntimeError(f"compression {codec} failed (exit {proc.returncode}):\n{tail}")
    if done.group(3) != name:
        raise RuntimeError(f"asked {args.script} for compression {codec}, but it reports "
                           f"{done.group(3)}: does it take the options {' '.join(how)}?")
    curve = [(int(m.group(1)), float(m.group(2))) for m in _STEP.finditer(proc.stdout)]
    held, temp = _HELD.search(proc.stdout), _TEMP.search(proc.stdout)
    mean = _MEAN.search(proc.stdout)
    return {"codec": codec, "held_out_loss": float(done.group(1)),
            "held_mib_per_process": float(held.group(1)) if held else float("nan"),
            "step_temp_mib": float(temp.group(1)) if temp else float("nan"),
            "median_step_ms": float(done.group(2)),
            "mean_step_ms": float(mean.group(1)) if mean else float("nan"),
            "sent_mib_per_step": float(done.group(4)),
            "state_mib_per_process": float(done.group(5)) if done.group(5) else float("nan"),
            "held_out_curve": curve}


def _mean_over_seeds(codec: str, runs: list[dict]) -> dict:
    """One codec's row from its runs, one per seed (in --seeds order): the
    means of the held-out losses (curve step by step) and of the bytes, the
    median of the median steps, and the runs themselves under "seeds"."""
    steps = [s for s, _ in runs[0]["held_out_curve"]]
    if any([s for s, _ in r["held_out_curve"]] != steps for r in runs):
        raise RuntimeError(f"the runs of {codec} logged held-out losses at different steps: "
                           f"{[[s for s, _ in r['held_out_curve']] for r in runs]}")
    curve = [(s, float(np.mean([r["held_out_curve"][k][1] for r in runs])))
             for k, s in enumerate(steps)]
    return {"codec": codec, "held_out_loss": float(np.mean([r["held_out_loss"] for r in runs])),
            "median_step_ms": float(np.median([r["median_step_ms"] for r in runs])),
            "mean_step_ms": float(np.mean([r["mean_step_ms"] for r in runs])),
            "sent_mib_per_step": float(np.mean([r["sent_mib_per_step"] for r in runs])),
            "state_mib_per_process": float(np.mean([r["state_mib_per_process"] for r in runs])),
            "held_mib_per_process": float(np.mean([r["held_mib_per_process"] for r in runs])),
            "step_temp_mib": float(np.mean([r["step_temp_mib"] for r in runs])),
            "held_out_curve": curve, "seeds": runs}


def _plot_codecs(args, results: list[dict], base: dict | None, seeds: int) -> None:
    """--codecs --plot: held-out loss against the steps and, next to it, each
    codec's distance from the uncompressed run at every step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 if base else 1, figsize=(12 if base else 7, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    for r in results:
        steps, losses = zip(*r["held_out_curve"]) if r["held_out_curve"] else ((), ())
        ax.plot(steps, losses, label=f"{r['codec']} ({r['held_out_loss']:.4f})")
    # The first evaluation (untrained) would flatten the rest of the curves;
    # a diverged run's inf or NaN cannot set a limit.
    later = [x for r in results for s, x in r["held_out_curve"][1:] if math.isfinite(x)]
    if later:
        ax.set_ylim(min(later) - 0.05, max(later) + 0.05)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    seeded = f", mean of {seeds} seeds" if seeds > 1 else ""
    ax.set_title(f"{os.path.basename(args.script)}, {args.num_processes} processes{seeded}")
    ax.legend(fontsize=8)
    if base:
        ax = axes[0][1]
        ref = dict(base["held_out_curve"])
        for r in results:
            pts = [(s, 100 * (x / ref[s] - 1)) for s, x in r["held_out_curve"] if s in ref]
            if pts:
                ax.plot(*zip(*pts), label=r["codec"])
        ax.axhline(3, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss vs none (%)")
        # Between the mean curves; the table's "vs none" is the mean of the
        # per-seed distances, which differs a little.
        ax.set_title("distance from the uncompressed run")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {args.plot}")


def run_codecs(args: argparse.Namespace) -> int:
    """--codecs: one N-process training run per codec; table, JSON and plot."""
    from herring_jax._src.collectives import codecs as codecs_lib
    names = [c for c in args.codecs.split(",") if c]
    unknown = [c for c in names if _codec_args(c) is None]
    if unknown or not names:
        print(f"herring-jax train-bench: unknown codecs {unknown}; known: "
              f"{', '.join(codecs_lib.CODECS)}, powersgd<rank>[-<codec>][-it<iterations>] "
              "(e.g. powersgd4-bf16-it2), topk<fraction> (e.g. topk0.01), sharded[-<codec>], "
              "fully[-reshard][-<codec>], localsgd|slowmo|diloco<H>[f<F>][d<D>][-<codec>] "
              "(e.g. diloco16-int8, diloco16f4d2-int8), compute; a lossy codec's name "
              "+ -noef: without error feedback (int8-noef, fully-int8-noef)", file=sys.stderr)
        return 2
    if len(set(names)) != len(names):
        print(f"herring-jax train-bench: a codec is named twice in --codecs {args.codecs}",
              file=sys.stderr)
        return 2
    seeds = [None]
    if args.seeds is not None:
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            seeds = []
        if not seeds or len(set(seeds)) != len(seeds):
            print(f"herring-jax train-bench: --seeds takes distinct comma-separated integers, "
                  f"got {args.seeds!r}", file=sys.stderr)
            return 2
        if any(a == "--seed" or a.startswith("--seed=") for a in args.script_args):
            print("herring-jax train-bench: give the seeds with --seeds, not as the script's "
                  "--seed", file=sys.stderr)
            return 2
    env = _run_env(args)
    where = "over the simulated network"
    if "--netns" not in args.launch_args.split():
        env["HERRING_HOST_STAGE"] = "0"
        where = "one host, HERRING_HOST_STAGE=0 (every process over the transport)"
    print(f"herring-jax train-bench --codecs: {args.script}, {args.num_processes} processes, "
          f"{args.steps} steps, {where}", flush=True)
    runs = {codec: [] for codec in names}
    width = max(9, *(len(c) for c in names))
    for seed in seeds:
        for codec in names:
            try:
                r = _run_codec(args, codec, env, seed)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"herring-jax train-bench: {e}", file=sys.stderr)
                return 1
            r["seed"] = seed
            runs[codec].append(r)
            seeded = "" if seed is None else f" (seed {seed})"
            print(f"  {codec:>{width}}{seeded}: held-out loss {r['held_out_loss']:.4f}, "
                  f"median step {r['median_step_ms']:.1f} ms (mean {r['mean_step_ms']:.1f}), "
                  f"{r['sent_mib_per_step']:.3f} MiB "
                  f"sent per step, optimizer state {r['state_mib_per_process']:.3f} MiB per "
                  "process", flush=True)
    results = [_mean_over_seeds(codec, runs[codec]) for codec in names]
    base = next((r for r in results if r["codec"] == "none"), None)
    several = len(seeds) > 1
    if several:
        print(f"means over seeds {', '.join(str(x) for x in seeds)}; vs none is the mean of "
              "the per-seed distances")
    print(f"{'codec':>{width}} {'held-out':>9} {'vs none':>8} {'step ms':>8} {'mean ms':>8} "
          f"{'MiB/step':>9} "
          f"{'bytes x':>8} {'state MiB':>9} {'held MiB':>8} {'temp MiB':>8}"
          + ("  vs none per seed" if several and base else ""))
    for r in results:
        per_seed = ""
        if base:
            gaps = [x["held_out_loss"] / y["held_out_loss"] - 1
                    for x, y in zip(runs[r["codec"]], runs["none"])]
            r["loss_vs_none"] = float(np.mean(gaps))
            # None where nothing was sent (compute): no ratio to print.
            sent = r["sent_mib_per_step"]
            r["bytes_reduction"] = base["sent_mib_per_step"] / sent if sent > 0 else None
            r["loss_vs_none_per_seed"] = gaps
            if several:
                per_seed = "  " + " ".join(f"{g:+.2%}" for g in gaps)
        vs = f"{r['loss_vs_none']:+.2%}" if base else "-"
        fewer = f"{r['bytes_reduction']:.2f}" if base and r["bytes_reduction"] else "-"
        print(f"{r['codec']:>{width}} {r['held_out_loss']:>9.4f} {vs:>8} "
              f"{r['median_step_ms']:>8.1f} {r['mean_step_ms']:>8.1f} "
              f"{r['sent_mib_per_step']:>9.3f} {fewer:>8} "
              f"{r['state_mib_per_process']:>9.3f} {r['held_mib_per_process']:>8.3f} "
              f"{r['step_temp_mib']:>8.3f}" + per_seed)
    if base:
        _print_time_to_loss(results, base)
    # The JSON first: a plot that fails must not lose the runs.
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"script": args.script, "steps": args.steps,
                       "seeds": seeds if args.seeds is not None else None,
                       "processes": args.num_processes, "launch_args": args.launch_args,
                       "where": where, "cpus": os.cpu_count(), "results": results}, f, indent=1)
    if args.plot:
        _plot_codecs(args, results, base, len(seeds))
    return 0


def _launch_worker(args, n: int, launch_args: str, module: str, worker_args: list[str],
                   marker: str, cwd: str) -> list[dict]:
    """Runs `python -m module` on n processes under herring-jax launch and
    returns the JSON its ranks printed after `marker`; RuntimeError on failure."""
    cmd = [sys.executable, "-m", "herring_jax.launch", "-n", str(n), "--timeout",
           str(int(args.timeout)), *launch_args.split(), "--", sys.executable, "-m", module,
           *worker_args]
    env = _run_env(args)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=args.timeout + 60, check=False)
    lines = [ln.split(marker + " ", 1)[1] for ln in proc.stdout.splitlines()
             if marker + " " in ln]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout[-3000:] + proc.stderr[-3000:]).strip()
        raise RuntimeError(f"{module} on {n} processes failed (exit {proc.returncode}):\n{tail}")
    return [json.loads(x) for x in lines]


def run_overlap(args: argparse.Namespace) -> int:
    """--overlap: one job on N processes; prints the figures, writes JSON and PNG."""
    from herring_jax._src.tools import overlap_plot
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "timeline")
        try:
            found = _launch_worker(args, args.num_processes, args.launch_args,
                                   "herring_jax._src.tools.overlap_worker",
                                   ["--timeline", prefix, *args.script_args],
                                   "OVERLAP_RESULT", tmp)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"herring-jax train-bench --overlap: {e}", file=sys.stderr)
            return 1
        results = sorted(found, key=lambda r: r["rank"])
        for r in results:
            print(f"  rank {r['rank']}: compute {r['compute_ms']:.1f} ms (forward "
                  f"{r['forward_ms']:.1f}), reduction {r['reduction_ms']:.1f} ms, step "
                  f"{r['step_ms']:.1f} ms, hidden fraction {r['hidden_fraction']:.2f} (bound "
                  f"{r['hidden_fraction_bound']:.2f} after the forward pass alone, "
                  f"{r['hidden_fraction_bound_at_first_gradient']:.2f} after the forward pass "
                  f"and the last layer's gradients alone, {r['first_gradient_ms']:.1f} ms, "
                  f"{r['hidden_fraction_bound_at_first_issue']:.2f} after the step's first "
                  f"reduction was issued at {r['first_issue_ms']:.1f} ms), "
                  f"{r['reductions_per_step']:.0f} reductions "
                  f"per step, bitwise equal to unoverlapped: "
                  f"{r['bitwise_equal_to_unoverlapped']}")
        if results[0].get("fully_sharded"):
            print("fully_sharded: share of the gathers' time inside the forward pass: "
                  + ", ".join(f"rank {r['rank']} {r['gather_share_under_forward']:.2f}"
                              for r in results))
        worst = min(r["hidden_fraction"] for r in results)
        print(f"hidden fraction (worst rank): {worst:.2f}  [(compute + reduction - step) / "
              "min(compute, reduction), medians]")
        if args.plot:
            title = (f"{args.num_processes} processes {args.launch_args} "
                     f"{' '.join(args.script_args)}: hidden fraction {worst:.2f}")
            fully = any(a == "--fully-sharded" for a in args.script_args)
            forward = (float(np.median([r["forward_ms"] for r in results])) if fully else None)
            if overlap_plot.plot(prefix, args.plot, title, forward_ms=forward):
                print(f"timeline: {args.plot}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"launch_args": args.launch_args, "worker_args": args.script_args,
                           "cpus": os.cpu_count(), "results": results,
                           "timeline": overlap_plot.load(prefix)}, f)
    return 0


def _simulated(args, n: int, launch_args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return _launch_worker(args, n, launch_args, "herring_jax._src.tools.simulated_worker",
                              args.script_args, "SIMULATED_RESULT", tmp)[0]


def run_simulated(args: argparse.Namespace) -> int:
    """--simulated-accelerator: 1 process, then N; prints the scaling efficiency."""
    try:
        one = _simulated(args, 1, "")
        many = _simulated(args, args.num_processes, args.launch_args)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"herring-jax train-bench --simulated-accelerator: {e}", file=sys.stderr)
        return 1
    compute, reduction = one["step_ms"], many["reduction_ms"]
    forward = compute / 3  # forward takes a third: backward runs twice as long
    efficiency = one["step_ms"] / many["step_ms"]
    bound = compute / max(compute, forward + reduction)
    print(f"  {many['gradient_bytes'] / 2**20:.1f} MiB of gradients; step x1 (compute) "
          f"{compute:.0f} ms, reduction alone x{args.num_processes} {reduction:.0f} ms, step "
          f"x{args.num_processes} {many['step_ms']:.0f} ms")
    print(f"scaling efficiency {efficiency:.2f} (bound {bound:.2f}: no reduction can start "
          "before the forward pass ends; without overlap about "
          f"{compute / (compute + reduction):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launch_args": args.launch_args, "worker_args": args.script_args,
                       "one": one, "many": many, "scaling_efficiency": efficiency,
                       "bound": bound}, f, indent=1)
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs every (process count, reducer) pair and prints the table."""
    if args.overlap:
        return run_overlap(args)
    if args.seeds is not None and not args.codecs:
        print("herring-jax train-bench: --seeds goes with --codecs", file=sys.stderr)
        return 2
    if args.codecs:
        if not os.path.isfile(args.script):
            print(f"herring-jax train-bench: no training script at {args.script!r}; pass "
                  "--script", file=sys.stderr)
            return 2
        return run_codecs(args)
    if args.simulated_accelerator:
        return run_simulated(args)
    reducers = [r for r in args.reducers.split(",") if r]
    unknown = [r for r in reducers if r not in REDUCERS]
    if unknown or not reducers:
        print(f"herring-jax train-bench: unknown reducers {unknown}; known: "
              f"{', '.join(REDUCERS)}", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"herring-jax train-bench: no training script at {args.script!r}; pass --script",
              file=sys.stderr)
        return 2
    if args.num_processes < 2:
        print("herring-jax train-bench: -n must be at least 2", file=sys.stderr)
        return 2
    counts = [1, args.num_processes]
    print(f"herring-jax train-bench: {args.script}, {args.steps} steps, processes "
          f"{counts}, reducers {', '.join(reducers)}, {os.cpu_count()} CPUs", flush=True)
    results = []
    for n in counts:
        for reducer in reducers:
            try:
                r = _run_one(args, n, reducer)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"herring-jax train-bench: {e}", file=sys.stderr)
                return 1
            results.append(r)
            print(f"  {reducer:>7} x{n}: median step {r['median_step_ms']:.1f} ms, final loss "
                  f"{r['final_loss']:.4f}, rank 0 sent {r['sent_mib_per_step']:.3f} MiB per step",
                  flush=True)
    by = {(r["reduce"], r["processes"]): r for r in results}
    n = args.num_processes
    none_n = by.get(("none", n))
    print(f"{'reducer':>8} {'step x1 ms':>11} {'step x' + str(n) + ' ms':>11} "
          f"{'scaling eff':>12} {'comm eff':>9}")
    for reducer in reducers:
        one, many = by[(reducer, 1)], by[(reducer, n)]
        many["scaling_efficiency"] = one["median_step_ms"] / many["median_step_ms"]
        if none_n and reducer != "none":
            many["comm_efficiency"] = none_n["median_step_ms"] / many["median_step_ms"]
        comm = f"{many['comm_efficiency']:.2f}" if "comm_efficiency" in many else "-"
        print(f"{reducer:>8} {one['median_step_ms']:>11.1f} {many['median_step_ms']:>11.1f} "
              f"{many['scaling_efficiency']:>12.2f} {comm:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"script": args.script, "steps": args.steps, "processes": counts,
                       "launch_args": args.launch_args, "cpus": os.cpu_count(),
                       "results": results}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m herring_jax._src.tools.train_bench`."""
    from herring_jax._src.tools.help_format import HelpFormatter
    parser = argparse.ArgumentParser(prog="herring-jax train-bench", allow_abbrev=False,
                                     description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
