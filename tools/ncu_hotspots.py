#!/usr/bin/env python3
"""Where a kernel's time goes, from Nsight Compute's source page: the SASS of a profiled kernel
with each instruction's executions and warp-stall samples, cut into runs of instructions that
executed equally often (a loop body, one side of a branch). The runs that hold the most
instructions or samples are printed with their shares and main stall reasons.

    ncu --set full --kernel-name regex:K --launch-count 1 -o rep <command>
    ncu -i rep.ncu-rep --page source --csv --print-source sass > k.csv
    python3 tools/ncu_hotspots.py k.csv [--top 25] [--min-share 1.0]

scripts/gpu_check.sh profile runs both steps for epx's kernels and this on each. A file may
hold several kernels (each starts with its "Kernel Name" line); each is summed up apart.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
STALL = "stall_"
NOT_ISSUED = "(Not Issued)"


@dataclass
class Instruction:
    index: int
    source: str
    executed: int
    samples: int
    stalls: dict[str, int]


@dataclass
class Kernel:
    name: str
    code: list[Instruction] = field(default_factory=list)


def _int(text: str) -> int:
    text = text.strip().replace(",", "")
    return int(float(text)) if text and text != "-" else 0


def read_kernels(lines) -> list[Kernel]:
    """The kernels of one source-page CSV: a "Kernel Name" line, the header, the instructions."""
    kernels: list[Kernel] = []
    header: list[str] | None = None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1] if len(row) > 1 else "?"))
            header = None
        elif header is None and kernels:
            header = row
            col = {name: i for i, name in enumerate(header)}
            stall_cols = [(name[len(STALL):], i) for name, i in col.items()
                          if name.startswith(STALL) and NOT_ISSUED not in name]
        elif header is not None:
            cell = lambda name: row[col[name]] if name in col and col[name] < len(row) else ""
            kernels[-1].code.append(Instruction(
                index=len(kernels[-1].code), source=cell("Source").strip(), executed=_int(cell(EXECUTED)),
                samples=_int(cell(SAMPLES)), stalls={name: _int(row[i]) for name, i in stall_cols if i < len(row)}))
    return kernels


@dataclass
class Run:
    first: int
    last: int
    executed: int  # each instruction of the run's
    samples: int
    stalls: dict[str, int]

    @property
    def instructions(self) -> int:
        return self.executed * (self.last - self.first + 1)


def runs_of(code: list[Instruction]) -> list[Run]:
    """Consecutive instructions executed equally often, as runs."""
    runs: list[Run] = []
    for ins in code:
        if runs and runs[-1].executed == ins.executed:
            run = runs[-1]
            run.last, run.samples = ins.index, run.samples + ins.samples
        else:
            run = Run(ins.index, ins.index, ins.executed, ins.samples, {})
            runs.append(run)
        for name, n in ins.stalls.items():
            run.stalls[name] = run.stalls.get(name, 0) + n
    return runs


def top_stalls(stalls: dict[str, int], n: int = 3) -> str:
    ranked = sorted(((v, k) for k, v in stalls.items() if v), reverse=True)[:n]
    return ", ".join(f"{k} {v}" for v, k in ranked) or "-"


def report(kernel: Kernel, top: int, min_share: float) -> str:
    runs = runs_of(kernel.code)
    inst = sum(r.instructions for r in runs) or 1
    samples = sum(r.samples for r in runs) or 1
    stalls: dict[str, int] = {}
    for r in runs:
        for k, v in r.stalls.items():
            stalls[k] = stalls.get(k, 0) + v
    out = [f"kernel {kernel.name}",
           f"  {len(kernel.code)} SASS instructions, {inst} warp instructions executed, {samples} stall samples",
           f"  stalls: {top_stalls(stalls, 8)}",
           f"  {'run':>11} {'length':>6} {'executed':>9} {'inst %':>6} {'samp %':>6}  first instruction | main stalls"]
    share = lambda r: max(100.0 * r.instructions / inst, 100.0 * r.samples / samples)
    picked = sorted((r for r in runs if share(r) >= min_share), key=share, reverse=True)[:top]
    for r in sorted(picked, key=lambda r: r.first):
        first = kernel.code[r.first].source[:44]
        out.append(f"  {r.first:>5}-{r.last:<5} {r.last - r.first + 1:>6} {r.executed:>9} "
                   f"{100.0 * r.instructions / inst:>6.1f} {100.0 * r.samples / samples:>6.1f}  {first} | "
                   f"{top_stalls(r.stalls)}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > FILE")
    ap.add_argument("--top", type=int, default=25, help="runs printed per kernel (default 25)")
    ap.add_argument("--min-share", type=float, default=1.0,
                    help="percent of the instructions or samples a run needs to be printed (default 1)")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        kernels = read_kernels(f)
    if not kernels or not any(k.code for k in kernels):
        print(f"{args.csv}: no kernel's source page found", file=sys.stderr)
        return 2
    print("\n\n".join(report(k, args.top, args.min_share) for k in kernels if k.code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
