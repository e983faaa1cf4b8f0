"""Rank 0's report of `herring-jax bench`: a table per collective, the wrong
results (every run of every peer on every rank), and the JSON file. The bounds
and their formulas are collectives.py's."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics

from herring_jax._src.collectives import codecs
from herring_jax._src.tools.bench import ceiling
from herring_jax._src.tools.bench import collectives as coll
from herring_jax._src.tools.bench.peers import PEERS

# The last record of each rank: its process's figures, not a peer's timings.
PROCESS_RECORD = "_process"


def cases(collectives, sizes, names) -> list[tuple[str, float, str]]:
    """(collective, mib, peer) in the order every worker runs them: each
    collective, each size, each peer that has the collective."""
    if isinstance(collectives, str):
        collectives = coll.parse(collectives)
    return [(c, m, p) for c in collectives for m in sizes for p in names if PEERS[p].has(c)]


def summarize(plan, per_rank) -> list[dict]:
    """One JSON result per (collective, size, peer) of `plan` from every rank's records."""
    results = []
    for i, (collective, mib, peer) in enumerate(plan):
        ranks = [records[i] for records in per_rank]
        assert all(r.get("collective", "allreduce") == collective and r["mib"] == mib
                   and r["peer"] == peer for r in ranks)
        times = [r["times"] for r in ranks]
        results.append({
            "collective": collective, "mib": mib, "peer": peer,
            # Each rank's median and minimum, then the slowest rank: a
            # collective is done when its last process is.
            "median_s": max(statistics.median(t) for t in times),
            "min_s": max(min(t) for t in times),
            # Iteration k as the job saw it (its slowest rank).
            "times_s": [max(col) for col in zip(*times)],
            "times_by_rank_s": times,
            # Every run (warm-up and timed) of this size and peer, on every rank.
            "correct": all(r["correct"] for r in ranks),
            "wrong_ranks": [k for k, r in enumerate(ranks) if not r["correct"]],
        })
        if all("messages_per_run" in r for r in ranks):  # herring: its transport's counters
            results[-1]["messages_per_run"] = max(r["messages_per_run"] for r in ranks)
            results[-1]["bytes_sent_per_run"] = max(r["bytes_sent_per_run"] for r in ranks)
    return results


def wrong_line(peer: str, mib: float, rank: int, wrong: dict,
               collective: str = "allreduce") -> str:
    """One wrong run, named: peer, collective (other than all-reduce), size, run and rank."""
    what = "" if collective == "allreduce" else f"{collective}, "
    return (f"WRONG RESULT: peer {peer}, {what}{mib:g} MiB, {wrong['run']}, rank {rank}: "
            f"{wrong['what']}")


def wrong_lines(per_rank) -> list[str]:
    """A line for every wrong run in every rank's records, in the order they ran."""
    lines = []
    for i in range(len(per_rank[0]) if per_rank else 0):
        for rank, records in enumerate(per_rank):
            r = records[i]
            lines += [wrong_line(r["peer"], r["mib"], rank, w, r.get("collective", "allreduce"))
                      for w in r.get("wrong_runs", ())]
    return lines


def _bound(args, n: int, model: dict | None):
    """collectives.bound_s for this run's figures: (collective, nbytes) -> seconds or None.
    With server-only processes (`model`, from --server-model) it is the flow bound
    of the collective's layout (ceiling.flow_bound_s)."""
    kind = getattr(args, "bound_kind", "link")
    hosts = n // max(1, getattr(args, "processes_per_host", 1))

    def bound(collective: str, nbytes: float, peer: str = "herring") -> float | None:
        if model:
            # The engine judges a buffer by its bytes on the wire (encoded,
            # with a codec): HERRING_SERVER_MIN_BYTES.
            served = nbytes * wire_fraction(peer) >= model["min_bytes"]
            share = model["share"] if collective == "allreduce" else model["block_share"]
            return ceiling.flow_bound_s(model["hosts"], model["servers"],
                                        share if served else 0.0, nbytes,
                                        model["host_bps"], model["flow_bps"], collective)
        return coll.bound_s(collective, nbytes, n, args.link_gbps, kind, hosts)
    return bound


def wire_fraction(peer: str) -> float:
    """The share of a buffer's bytes that peer sends: < 1 for herring with a
    codec, whose bound is that of the bytes on the wire."""
    codec = getattr(PEERS.get(peer), "codec", "none")
    return codecs.wire_bytes(codec, 1 << 20) / (4 << 20)


def _nbytes(r: dict, n: int) -> int:
    """The bytes of result r's buffer (collectives.py: the same S for every collective)."""
    return coll.elements(r["mib"], r.get("collective", "allreduce"), n) * 4


def table(results, n, bound) -> str:
    """The rows of one collective's results."""
    by = {(r["mib"], r["peer"]): r for r in results}
    rows = [f"{'size MiB':>8} {'peer':>12} {'median ms':>10} {'min ms':>8} {'algbw GB/s':>10} "
            f"{'busbw GB/s':>10} {'herring x':>10} {'bound ms':>9} {'ok':>3}"]
    for r in results:
        nbytes, collective = _nbytes(r, n), r.get("collective", "allreduce")
        algbw = nbytes / r["median_s"] / 1e9
        herring = by.get((r["mib"], "herring"))
        speedup = f"{r['median_s'] / herring['median_s']:.2f}" if herring else "-"
        limit = bound(collective, nbytes, r["peer"])
        limit = None if limit is None else limit * wire_fraction(r["peer"])
        # "!" marks a run faster than the bound: then the rate is not what the
        # transport (or memory) can carry, and the bound is no bound.
        bound_text = "-" if limit is None else (
            f"{limit * 1e3:.1f}" + ("!" if r["median_s"] < limit else ""))
        busbw = algbw * coll.BUS_FACTORS[collective](n)
        rows.append(f"{r['mib']:>8g} {r['peer']:>12} {r['median_s'] * 1e3:>10.1f} "
                    f"{r['min_s'] * 1e3:>8.1f} {algbw:>10.3f} {busbw:>10.3f} "
                    f"{speedup:>10} {bound_text:>9} {'yes' if r['correct'] else 'NO':>3}")
    return "\n".join(rows)


def _notes(results, n, bound) -> list[str]:
    """The lines under a collective's table: herring's share of the bound,
    codecs against uncompressed herring, and the transport's counters."""
    lines = []
    for r in results:
        collective = r.get("collective", "allreduce")
        limit = bound(collective, _nbytes(r, n), r["peer"])
        if limit and r["peer"].startswith("herring"):
            limit *= wire_fraction(r["peer"])
            lines.append(f"{r['peer']} at {r['mib']:g} MiB: {limit / r['median_s']:.0%} of the "
                         f"bound ({limit / r['min_s']:.0%} at its minimum)"
                         + ("" if r["peer"] == "herring" else " of the bytes it sends"))
        base = next((b for b in results if b["mib"] == r["mib"] and b["peer"] == "herring"), None)
        if r["peer"].startswith("herring_") and base:
            lines.append(f"{r['peer']} at {r['mib']:g} MiB: "
                         f"{base['median_s'] / r['median_s']:.2f}x as fast as herring "
                         f"uncompressed in this run")
        if "messages_per_run" in r:
            lines.append(f"{r['peer']} at {r['mib']:g} MiB, per {collective}, the busiest rank's "
                         f"transport: {r['messages_per_run']:.0f} messages, "
                         f"{r['bytes_sent_per_run'] / 2**20:.2f} MiB sent")
    return lines


def report(args, n, sizes, names, per_rank, describe, jax) -> dict:
    """Prints a table per collective and every wrong run, writes --json; returns the report."""
    rss = [r["max_rss_mib"] for records in per_rank for r in records
           if r.get("peer") == PROCESS_RECORD]
    per_rank = [[r for r in records if r.get("peer") != PROCESS_RECORD] for records in per_rank]
    collectives = coll.parse(getattr(args, "collective", "allreduce"))
    results = summarize(cases(collectives, sizes, names), per_rank)
    model = json.loads(getattr(args, "server_model", None) or "null")
    bound = _bound(args, n, model)
    memory = getattr(args, "bound_kind", "link") == "memory"
    formulas = dict(coll.MEMORY_FORMULAS if memory else coll.LINK_FORMULAS)
    if model:
        for c in formulas:
            share, what = ((model["share"], "buffer") if c == "allreduce"
                           else (model["block_share"], "block (a process's part)"))
            formulas[c] = (
                f"bound = the busiest host's sends with {model['servers']} server-only "
                f"process{'es' if model['servers'] > 1 else ''} taking {share:.3g} of each "
                f"{what} of buffers of at least {model['min_bytes']} bytes on the wire (a "
                f"host's flows share its link alike, each at most the flow rate: ceiling.py)")
    rate = (f"{'memory' if memory else 'link'} = {args.link_gbps:.2f} GB/s from "
            f"{args.link_source}" if args.link_gbps else "no rate (pass --link-gbps)")
    unsupported = {c: {p: PEERS[p].describe(c) for p in names if not PEERS[p].has(c)}
                   for c in collectives}
    print(f"transport: {describe}")
    print("time: median (and min) of each rank's timed runs, slowest rank; bytes = the buffer "
          "of S MiB; algbw = bytes / median; busbw = algbw * 2(n-1)/n (all-reduce) or "
          "(n-1)/n (reduce-scatter, all-gather); herring x = peer median / herring median "
          "(>1: herring faster)")
    for c in collectives:
        mine = [r for r in results if r["collective"] == c]
        print(f"\n{c}: {coll.SEMANTICS[c]}; {formulas[c]}, {rate}")
        print("peers: " + "; ".join(f"{p} = {PEERS[p].describe(c)}" for p in names
                                    if PEERS[p].has(c)))
        print(table(mine, n, bound), flush=True)
        for line in _notes(mine, n, bound):
            print(line)
        for p, why in unsupported[c].items():
            print(f"UNSUPPORTED: {p} {c}: {why}")
    if rss:
        print(f"peak memory per process (every peer's buffers, jax and the libraries): "
              f"{min(rss):.0f} to {max(rss):.0f} MiB")
    if any(r["median_s"] < (bound(r["collective"], _nbytes(r, n), r["peer"]) or 0)
           * wire_fraction(r["peer"]) for r in results):
        print("!: faster than the bound: the rate given is below what the transport (or "
              "memory) carries, so this bound is no bound")
    wrong = wrong_lines(per_rank)
    for line in wrong:
        print(line)
    if wrong:
        print(f"{len(wrong)} run{'s' if len(wrong) > 1 else ''} gave a wrong result: the timings "
              f"of those peers and sizes mean nothing", flush=True)
    missing = json.loads(getattr(args, "missing", "{}"))
    for name, why in missing.items():
        print(f"MISSING peer {name}: {why}")
    bounds = {c: {str(mib): bound(c, coll.elements(mib, c, n) * 4) for mib in sizes}
              for c in collectives}
    result = {
        "n": n, "sizes_mib": sizes, "peers": names, "collectives": collectives,
        "iters": args.iters, "warmup": args.warmup,
        "provider": os.environ.get("HERRING_FI_PROVIDER") or "(default)", "transport": describe,
        "link_gbps": None if memory else args.link_gbps,
        "memory_gbps": args.link_gbps if memory else None,
        "link_source": args.link_source if args.link_gbps else None,
        "processes_per_host": getattr(args, "processes_per_host", 1),
        "bound_formulas": {c: formulas[c] for c in collectives}, "bounds_s": bounds,
        "peer_labels": {c: {p: PEERS[p].describe(c) for p in names if PEERS[p].has(c)}
                        for c in collectives},
        "unsupported": unsupported,
        "results": results, "missing": missing, "max_rss_mib_by_rank": rss,
        "network": os.environ.get("HERRING_BENCH_NETWORK", "loopback"),
        "jax": jax.__version__, "jaxlib": _jaxlib_version(), "python": platform.python_version(),
        "host": platform.node(), "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if "allreduce" in collectives:  # the keys of the all-reduce-only reports before them
        result["bound_formula"] = formulas["allreduce"]
        result["bound_s"] = bounds["allreduce"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _jaxlib_version() -> str:
    import jaxlib
    return getattr(jaxlib, "__version__", "?")
