#!/usr/bin/env python3
"""Turns epx-bench's JSON into a PNG: bandwidth against tokens per rank (--sweep tokens) and
bytes per SM-second against SMs per rank (--sweep sms), dispatch and combine side by side,
with the floor and the all-to-all baseline drawn.

    epx-bench --sweep tokens --json tokens.json
    epx-bench --sweep tokens --mode a2a --layout expert --json a2a.json
    python3 tools/plot_bench.py --out bench.png tokens.json a2a.json

Each input holds one run, one sweep, or lines of either (gpu_check's bench.jsonl). What is
plotted against tokens: the bytes each phase reads and writes in memory per second, all ranks
of the emulated group together, with the device's copy bandwidth as the floor; when the ranks
were on one GPU each, the busiest GPU's link bytes per second with NVLink's 450 GB/s instead.
Against SMs: bytes read + written per SM-second, with the best copy kernel's figure measured
by the same run. Needs matplotlib (an optional dependency: without it this says so and exits 3).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("dispatch", "combine")
NVLINK_GBPS = 450.0


def load_runs(paths):
    """Every run in the files, each with the 'sweep' it came from ('' for a single run)."""
    runs = []
    for path in paths:
        text = Path(path).read_text()
        try:
            docs = [json.loads(text)]
        except json.JSONDecodeError:
            docs = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
        for doc in docs:
            if "runs" in doc:
                runs += [dict(r, sweep=doc["sweep"], machine=doc.get("machine", {})) for r in doc["runs"]]
            elif "mode" in doc:  # an epx-bench run (gpu_check's lines also hold NCCL's, without one)
                runs.append(dict(doc, sweep=doc.get("sweep", "")))
    return runs


def series_name(r):
    if r["mode"] == "a2a":
        return f"all-to-all baseline ({r['layout']} layout)"
    name = {"ht": "epx", "ll": "epx low-latency"}[r["mode"]] + f", {r['layout']} layout"
    return name + (", fp8" if r["recv_dtype"] == "fp8_e4m3" else "")


def tokens_figure(r, phase):
    """(GB/s, floor GB/s, what the axis means) of one run for the tokens plot."""
    if r.get("devices", 1) > 1 and f"{phase}_nvlink_gbps_per_gpu" in r:
        return r[f"{phase}_nvlink_gbps_per_gpu"], NVLINK_GBPS, "link GB/s per GPU (busiest GPU)"
    gbps = r[f"{phase}_memory_bytes"] / (r[f"{phase}_ms"] * 1e-3) * 1e-9
    return gbps, r["copy_gbps"], "memory GB/s, read + written, all ranks"


def group(runs, sweep, x_key):
    """{series name: sorted [(x, run)]} of the runs of one kind of sweep."""
    out = defaultdict(list)
    for r in runs:
        if r["sweep"] == sweep or (sweep == "tokens" and r["sweep"] == ""):
            out[series_name(r)].append((r[x_key], r))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def style(name):
    return {"linestyle": "--", "marker": "s"} if name.startswith("all-to-all") else {"linestyle": "-", "marker": "o"}


def plot_tokens(ax, series, phase):
    floors, label = {}, ""
    for name, pts in series.items():
        figs = [tokens_figure(r, phase) for _, r in pts]
        label = figs[0][2]
        ax.plot([x for x, _ in pts], [f[0] for f in figs], label=name, **style(name))
        floors.update({x: f[1] for (x, _), f in zip(pts, figs)})
    if floors:
        xs = sorted(floors)
        ax.plot(xs, [floors[x] for x in xs], color="black", linestyle=":", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(label)
    ax.set_title(f"{phase}")
    ax.set_ylim(bottom=0)


def plot_sms(ax, series, phase):
    ref = {}
    for name, pts in series.items():
        ax.plot([x for x, _ in pts], [r[f"{phase}_gbps_per_sm"] for _, r in pts], label=name, **style(name))
        ref.update({x: r["sm_copy_gbps_per_sm"] for x, r in pts})
    if ref:
        xs = sorted(ref)
        ax.plot(xs, [ref[x] for x in xs], color="black", linestyle=":", label="best copy kernel (per-SM floor)")
    ax.set_xticks(sorted(ref))
    ax.set_xlabel("SMs per rank")
    ax.set_ylabel("GB/s per SM, read + written")
    ax.set_title(f"{phase}, by SM budget")
    ax.set_ylim(bottom=0)


def caption(runs):
    r = runs[0]
    m = r.get("machine", {})
    where = m.get("device") or f"{m.get('cpu', 'CPU')} ({m.get('cpus', '?')} CPUs), host backend"
    return (f"epx {m.get('epx_version', '')}: EP{r['ranks']}, H {r['hidden']}, {r['experts']} experts, top-{r['topk']}, "
            f"{r['dtype']}; {where}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="epx-bench --json outputs")
    ap.add_argument("--out", default="bench.png", help="the PNG to write (default bench.png)")
    ap.add_argument("--title", default=None, help="a first line for the figure (e.g. the date and commit)")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 3
    runs = load_runs(args.json)
    rows = [(kind, group(runs, kind, key)) for kind, key in (("tokens", "tokens"), ("sms", "num_sms"))]
    rows = [(kind, s) for kind, s in rows if s]
    if not rows:
        print("plot_bench: no epx-bench runs in " + ", ".join(args.json), file=sys.stderr)
        return 2
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 4.6 * len(rows)), squeeze=False)
    for (kind, series), ax_row in zip(rows, axes):
        for phase, ax in zip(PHASES, ax_row):
            (plot_tokens if kind == "tokens" else plot_sms)(ax, series, phase)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("\n".join(t for t in (args.title, caption(runs)) if t), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_bench: wrote {args.out} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
