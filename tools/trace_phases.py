#!/usr/bin/env python3
"""Phase times from a trace build's output (src/cuda/trace.cuh: -DEPX_LL_TRACE,
-DEPX_NOTIFY_TRACE, -DEPX_EXCHANGE_TRACE), summed up per kind of launch: for each phase, when
it ended (us since the launch's or the block's start) as min / median / max over the launches
seen.

    build-trace/... epx-bench --backend cuda --mode ll --graph ... > ll.txt
    python3 tools/trace_phases.py ll.txt [--skip N]

A line is "<kind> <block>: <start ns> <mark 1 - start> ... <mark 11 - start>", marks not taken
printed as 0. Low-latency lines name their phases in the kind ("lltrace dispatch plan stage
..."), come from each rank's block 1 and carry the rank in the block field: the phases are
summed over rank 0's, and each rank's start and end are given since the step's first start
(the n-th line of every rank is one step). Notify's build tickets ("notifytrace build") build
and scan; its closing block ("notifytrace close") meets the peers, waits for the tickets,
pushes its counts, gathers the peers' and derives the receive side; their block field is
rank * 1000 + ticket. A rank's blocks of one launch are its lines whose
starts lie within --window us of the launch's first. The phases are rank 0's, also given
since the launch's first start (the whole launch as one rank saw it); with several ranks the
n-th launch of each is one step, and each rank's start, when its slowest block was done and
its end are given since the step's first start, then the phases of the rank that started
last (its slowest build ticket's, and its closing block's). --skip drops each kind's first N
launches (warm-up).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass

NOTIFY_KIND = "notifytrace"
LL_KIND = "lltrace"  # lines carry the rank in the block field
NOTIFY_BUILD_PHASES = ["built", "scanned"]  # a build ticket's marks ("notifytrace build")
NOTIFY_CLOSE_PHASES = ["met the peers", "tickets built", "pushed", "gathered", "receive side"]  # "notifytrace close"
NOTIFY_PHASES = NOTIFY_BUILD_PHASES + NOTIFY_CLOSE_PHASES
RANK_BLOCKS = 1000  # a notify line's block field: rank * RANK_BLOCKS + ticket (EPXC_TRACE_RANK_BLOCKS)
LINE = re.compile(r"^(?P<kind>[a-z]+trace[^:]*?) (?P<block>\d+): (?P<start>\d+)(?P<marks>( \d+)*)\s*$")


@dataclass
class Mark:
    kind: str  # the kind with its phase names, e.g. "lltrace dispatch plan stage post"
    block: int
    start: int  # ns
    marks: list[int]  # ns since start, the taken ones only


def parse(lines) -> list[Mark]:
    out = []
    for line in lines:
        m = LINE.match(line.strip())
        if not m:
            continue
        marks = [int(x) for x in m["marks"].split()]
        while marks and marks[-1] == 0:
            marks.pop()
        out.append(Mark(m["kind"], int(m["block"]), int(m["start"]), marks))
    return out


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def names_of(kind: str) -> tuple[str, list[str]]:
    """The launch kind and its phase names: "lltrace dispatch plan stage" -> ("dispatch", ["plan", "stage"])."""
    words = kind.split()
    if words[0] == NOTIFY_KIND:
        return "notify", NOTIFY_PHASES
    return words[1], words[2:]


def launches(marks: list[Mark], window_us: float) -> list[list[Mark]]:
    """Notify's lines cut into launches: blocks whose starts lie within the window of the first."""
    out: list[list[Mark]] = []
    for m in sorted(marks, key=lambda m: m.start):
        if out and m.start - out[-1][0].start <= window_us * 1000:
            out[-1].append(m)
        else:
            out.append([m])
    return out


def notify_marks(m: Mark) -> list[tuple[int, int]]:
    """A notify line's marks as (phase index in NOTIFY_PHASES, ns since the block's start)."""
    base = len(NOTIFY_BUILD_PHASES) if is_closer(m) else 0
    return [(base + i, t) for i, t in enumerate(m.marks)]


def is_closer(m: Mark) -> bool:
    return m.kind.split()[1:2] == ["close"]


def summarise_notify(marks: list[Mark], skip: int, window_us: float) -> list[str]:
    by_rank: dict[int, list[Mark]] = {}
    for m in marks:
        by_rank.setdefault(m.block // RANK_BLOCKS, []).append(m)
    ranks = sorted(by_rank)
    steps = {r: launches(by_rank[r], window_us)[skip:] for r in ranks}
    groups = steps[ranks[0]]
    per_block = [[] for _ in NOTIFY_PHASES]  # since each block's own start
    per_launch = [[] for _ in NOTIFY_PHASES]  # since the launch's first start
    for g in groups:
        first = g[0].start
        for m in g:
            for i, t in notify_marks(m):
                per_block[i].append(t / 1000)
                per_launch[i].append((m.start - first + t) / 1000)
    rows = [f"notify: {len(groups)} launches, {sum(len(g) for g in groups)} block lines "
            "(us, min / median / max; since the block's start | since the launch's first start)"]
    for i, name in enumerate(NOTIFY_PHASES):
        who = "every build ticket" if i < len(NOTIFY_BUILD_PHASES) else "the closing block"
        rows.append(f"  {name:14} {spread(per_block[i]):24} | {spread(per_launch[i]):24} ({who})")
    return rows + (notify_ranks(steps, ranks) if len(ranks) > 1 else [])


def notify_launch(g: list[Mark], since: int) -> tuple[list[float], list[float]]:
    """One rank's launch: when its slowest build ticket ended each of its phases, and when the
    closing block ended its own, us since `since`."""
    builds = [m for m in g if not is_closer(m)]
    slowest = [max(((m.start - since + m.marks[i]) / 1000 for m in builds if i < len(m.marks)), default=0.0)
               for i in range(len(NOTIFY_BUILD_PHASES))]
    closer = [(m.start - since + t) / 1000 for m in g if is_closer(m) for t in m.marks[: len(NOTIFY_CLOSE_PHASES)]]
    return slowest, closer


def notify_ranks(steps: dict[int, list[list[Mark]]], ranks: list[int]) -> list[str]:
    """Every rank's notify, the n-th launch of each one step: each rank's start, when its
    slowest build ticket was done and its end, since the step's first start; then the phases of
    the rank that started last (its peers' posts are there when it looks: the step's own cost)."""
    n = min(len(v) for v in steps.values())
    rows = [f"  {n} steps of {len(ranks)} ranks (us since the step's first start, min / median / max):"]
    for r in ranks:
        started, done, ended = [], [], []
        for k in range(n):
            first = min(steps[q][k][0].start for q in ranks)
            g = steps[r][k]
            slowest, closer = notify_launch(g, first)
            started.append((g[0].start - first) / 1000)
            done.append(slowest[-1])
            ended.append(closer[-1] if closer else slowest[-1])
        rows.append(f"    rank {r}: started {spread(started)}, tickets built {spread(done)}, ended {spread(ended)}")
    rows.append("  the rank that started last, since its start (its slowest build ticket, then its closing block):")
    late = [max((steps[q][k] for q in ranks), key=lambda g: g[0].start) for k in range(n)]
    phases = [[] for _ in NOTIFY_PHASES]
    for g in late:
        slowest, closer = notify_launch(g, g[0].start)
        for i, t in enumerate(slowest + closer):
            phases[i].append(t)
    return rows + [f"    {name:14} {spread(phases[i])}" for i, name in enumerate(NOTIFY_PHASES)]


def phase_rows(ms: list[Mark], phases: list[str], indent: str) -> list[str]:
    """One row a phase: when it ended, us since each launch's start, over the launches ms."""
    return [f"{indent}{name:14} {spread([m.marks[i] / 1000 for m in ms if i < len(m.marks)])}"
            for i, name in enumerate(phases)]


def summarise(marks: list[Mark], skip: int = 0, window_us: float = 500.0) -> list[str]:
    rows: list[str] = []
    kinds: dict[str, list[Mark]] = {}
    for m in marks:  # a notify launch's build and closing lines together
        kinds.setdefault(NOTIFY_KIND if m.kind.split()[0] == NOTIFY_KIND else m.kind, []).append(m)
    for kind, ms in kinds.items():
        if kind.split()[0] == NOTIFY_KIND:
            rows += summarise_notify(ms, skip, window_us)
            continue
        what, phases = names_of(kind)
        ranks = sorted({m.block for m in ms}) if kind.split()[0] == LL_KIND else [None]
        first_rank = [m for m in ms if ranks[0] is None or m.block == ranks[0]][skip:]
        rows.append(f"{what}: {len(first_rank)} launches (us since the launch's start, min / median / max)")
        rows += phase_rows(first_rank, phases, "  ")
        if len(ranks) > 1:
            rows += summarise_ranks(ms, ranks, phases, skip)
    return rows


def summarise_ranks(ms: list[Mark], ranks: list[int], phases: list[str], skip: int) -> list[str]:
    """Low-latency lines of several ranks (the rank in the block field): the n-th line of each
    rank is one step; each rank's start and end since the step's first start, so the wait on a
    late peer shows apart from the kernel's own phases, and the phases of the rank that started
    last (its peers' posts are there when it looks: what the step itself costs)."""
    per_rank = {r: [m for m in ms if m.block == r][skip:] for r in ranks}
    steps = min(len(v) for v in per_rank.values())
    rows = [f"  {steps} steps of {len(ranks)} ranks (us since the step's first start, min / median / max):"]
    for r in ranks:
        started, ended = [], []
        for n in range(steps):
            first = min(per_rank[q][n].start for q in ranks)
            m = per_rank[r][n]
            started.append((m.start - first) / 1000)
            ended.append((m.start - first + (m.marks[-1] if m.marks else 0)) / 1000)
        rows.append(f"    rank {r}: started {spread(started)}, ended {spread(ended)}")
    # the last rank to start finds its peers' posts there: its phases are the step's own cost
    last = [max((per_rank[q][n] for q in ranks), key=lambda m: m.start) for n in range(steps)]
    return rows + ["  the rank that started last, since its start:"] + phase_rows(last, phases, "    ")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="trace output (default: stdin)")
    ap.add_argument("--skip", type=int, default=0, help="launches of each kind to drop first (warm-up)")
    ap.add_argument("--window", type=float, default=500.0, help="us within which notify's blocks are one launch")
    a = ap.parse_args(argv)
    lines = []
    for f in a.files or ["-"]:
        lines += (sys.stdin if f == "-" else open(f)).read().splitlines()
    rows = summarise(parse(lines), a.skip, a.window)
    print("\n".join(rows) if rows else "no trace lines")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
