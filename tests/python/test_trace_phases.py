"""tools/trace_phases.py on trace output made up here in trace.cuh's format: low-latency
launches summed per kind, notify's block lines cut into launches, warm-up launches skipped,
and lines of other output ignored."""

import statistics

from moe_ref import rng
from tool_module import load_tool


def _tool():
    return load_tool("trace_phases")


def _line(kind, block, start, marks):
    """trace_print's line: 11 marks after the start, those not taken 0."""
    return f"{kind} {block}: {start} " + " ".join(str(m) for m in marks + [0] * (11 - len(marks)))


def _ll_launches(g, n, phases):
    """n launches of rising phase ends (ns), each a list of len(phases) marks."""
    return [sorted(int(x) for x in g.integers(1000, 90000, len(phases))) for _ in range(n)]


def test_low_latency_phases_and_skip():
    mod = _tool()
    g = rng(0)
    kind = "lltrace dispatch plan stage post wait place copy"
    runs = _ll_launches(g, int(g.integers(3, 30)), kind.split()[2:])
    skip = int(g.integers(0, 3))
    text = ["epx-bench: backend cuda, 2 ranks", "dispatch 0.043 ..."]  # the benchmark's own lines
    text += [_line(kind, 0, 10**9 + 10**6 * i, r) for i, r in enumerate(runs)]
    rows = mod.summarise(mod.parse(text), skip=skip)
    assert rows[0] == f"dispatch: {len(runs) - skip} launches (us since the launch's start, min / median / max)"
    for i, name in enumerate(kind.split()[2:]):
        us = [r[i] / 1000 for r in runs[skip:]]
        assert rows[1 + i].split()[0] == name
        assert rows[1 + i].endswith(f"{min(us):.1f} / {statistics.median(us):.1f} / {max(us):.1f}")


def test_notify_blocks_cut_into_launches():
    mod = _tool()
    g = rng(1)
    blocks, launches = int(g.integers(2, 17)), int(g.integers(2, 6))
    lines, closer_done = [], []
    for L in range(launches):
        first = 5 * 10**9 + L * 10**7  # launches 10 ms apart; blocks start within 2 us
        for b in g.permutation(blocks):  # blocks print in any order
            start = first + int(g.integers(0, 2000)) if b else first
            if b == blocks - 1:  # the closing block's five marks
                marks = sorted(int(x) for x in g.integers(1000, 90000, 5))
                closer_done.append((start - first + marks[-1]) / 1000)
                lines.append(_line("notifytrace close", int(b), start, marks))
            else:
                marks = sorted(int(x) for x in g.integers(1000, 40000, 2))
                lines.append(_line("notifytrace build", int(b), start, marks))
    rows = mod.summarise(mod.parse(lines), skip=1)
    assert rows[0].startswith(f"notify: {launches - 1} launches, {(launches - 1) * blocks} block lines")
    done = rows[1 + mod.NOTIFY_PHASES.index("receive side")]
    want = closer_done[1:]
    since_launch = done.split("|")[1].split("(")[0].strip()
    assert since_launch == f"{min(want):.1f} / {statistics.median(want):.1f} / {max(want):.1f}"
    assert "(every build ticket)" in rows[1] and "(the closing block)" in done


def test_no_trace_lines(tmp_path, capsys):
    mod = _tool()
    path = tmp_path / "out.txt"
    path.write_text("epx-bench: nothing traced\n")
    assert mod.main([str(path)]) == 1
    assert "no trace lines" in capsys.readouterr().out


def test_exchange_steps_beside_a_kernel():
    """-DEPX_EXCHANGE_TRACE's lines (the phase as the block number) summed apart from the
    kernel lines they are printed among."""
    mod = _tool()
    g = rng(2)
    ex_kind = "extrace exchange_wait fenced flags read compared decided done"
    ll_kind = "lltrace combine partials arrive post wait sum"
    ex_runs = _ll_launches(g, int(g.integers(2, 20)), ex_kind.split()[2:])
    ll_runs = _ll_launches(g, len(ex_runs), ll_kind.split()[2:])
    lines = []
    for i, (e, k) in enumerate(zip(ex_runs, ll_runs)):
        lines += [_line(ex_kind, int(g.integers(0, 9)), 10**9 + 10**6 * i, e), _line(ll_kind, 0, 10**9 + 10**6 * i, k)]
    rows = mod.summarise(mod.parse(lines))
    at = rows.index(f"exchange_wait: {len(ex_runs)} launches (us since the launch's start, min / median / max)")
    decided = [r[4] / 1000 for r in ex_runs]
    assert rows[at + 5].split()[0] == "decided"
    assert rows[at + 5].endswith(f"{min(decided):.1f} / {statistics.median(decided):.1f} / {max(decided):.1f}")
    assert f"combine: {len(ll_runs)} launches (us since the launch's start, min / median / max)" in rows


def test_low_latency_ranks_line_up():
    """Every rank's block 1 prints (the rank in the block field): the phases are rank 0's, and
    each rank's start and end are given since the step's first start."""
    mod = _tool()
    g = rng(3)
    kind = "lltrace combine found push meet sum"
    ranks, steps, skip = int(g.integers(2, 9)), int(g.integers(2, 12)), 1
    runs = {r: _ll_launches(g, steps, kind.split()[2:]) for r in range(ranks)}
    late = {r: [int(x) for x in g.integers(0, 20000, steps)] for r in range(ranks)}
    lines = []
    for n in range(steps):
        for r in g.permutation(ranks):  # ranks print in any order
            lines.append(_line(kind, int(r), 10**9 + 10**6 * n + late[int(r)][n], runs[int(r)][n]))
    rows = mod.summarise(mod.parse(lines), skip=skip)
    assert rows[0] == f"combine: {steps - skip} launches (us since the launch's start, min / median / max)"
    sums = [r[-1] / 1000 for r in runs[0][skip:]]
    assert rows[4].endswith(f"{min(sums):.1f} / {statistics.median(sums):.1f} / {max(sums):.1f}")
    assert rows[5].startswith(f"  {steps - skip} steps of {ranks} ranks")
    for r in range(ranks):
        first = [min(late[q][n] for q in range(ranks)) for n in range(skip, steps)]
        started = [(late[r][n] - f) / 1000 for n, f in zip(range(skip, steps), first)]
        ended = [(late[r][n] - f + runs[r][n][-1]) / 1000 for n, f in zip(range(skip, steps), first)]
        want = (f"    rank {r}: started {min(started):.1f} / {statistics.median(started):.1f} / {max(started):.1f}, "
                f"ended {min(ended):.1f} / {statistics.median(ended):.1f} / {max(ended):.1f}")
        assert rows[6 + r] == want
    assert rows[6 + ranks] == "  the rank that started last, since its start:"
    last = [max(range(ranks), key=lambda q: late[q][n]) for n in range(skip, steps)]
    for i, name in enumerate(kind.split()[2:]):
        us = [runs[q][n][i] / 1000 for q, n in zip(last, range(skip, steps))]
        assert rows[7 + ranks + i] == f"    {name:14} {min(us):.1f} / {statistics.median(us):.1f} / {max(us):.1f}"


def test_notify_ranks_line_up():
    """Every rank's notify blocks print (block field rank * 1000 + ticket): rank 0's phases as
    before, then each rank's start, slowest build ticket and end since the step's first start,
    and the phases of the rank that started last."""
    mod = _tool()
    g = rng(4)
    ranks, blocks, steps, skip = int(g.integers(2, 9)), int(g.integers(2, 17)), int(g.integers(2, 8)), 1
    late = {r: [int(x) for x in g.integers(0, 50000, steps)] for r in range(ranks)}
    lines, want = [], {}
    for n in range(steps):
        step0 = 10**9 + 10**7 * n
        for r in g.permutation(ranks):
            r = int(r)
            first = step0 + late[r][n]
            slowest, closer = [0, 0], None  # ns since the rank's first start
            for b in g.permutation(blocks):
                start = first + (int(g.integers(1, 2000)) if b else 0)
                if b == blocks - 1:
                    marks = sorted(int(x) for x in g.integers(1000, 90000, 5))
                    closer = [start - first + t for t in marks]
                    lines.append(_line("notifytrace close", r * mod.RANK_BLOCKS + int(b), start, marks))
                    continue
                marks = sorted(int(x) for x in g.integers(1000, 40000, 2))
                slowest = [max(s, start - first + t) for s, t in zip(slowest, marks)]
                lines.append(_line("notifytrace build", r * mod.RANK_BLOCKS + int(b), start, marks))
            want[r, n] = (late[r][n], slowest, closer)
    rows = mod.summarise(mod.parse(lines), skip=skip)
    assert rows[0].startswith(f"notify: {steps - skip} launches, {(steps - skip) * blocks} block lines")
    at = 1 + len(mod.NOTIFY_PHASES)
    assert rows[at] == f"  {steps - skip} steps of {ranks} ranks (us since the step's first start, min / median / max):"

    def spread(v):
        return f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}"

    kept = range(skip, steps)
    for r in range(ranks):
        first = {n: min(late[q][n] for q in range(ranks)) for n in kept}
        started = [(late[r][n] - first[n]) / 1000 for n in kept]
        done = [(late[r][n] - first[n] + want[r, n][1][-1]) / 1000 for n in kept]
        ended = [(late[r][n] - first[n] + want[r, n][2][-1]) / 1000 for n in kept]
        assert rows[at + 1 + r] == f"    rank {r}: started {spread(started)}, tickets built {spread(done)}, ended {spread(ended)}"
    assert rows[at + 1 + ranks].startswith("  the rank that started last, since its start")
    last = [max(range(ranks), key=lambda q: late[q][n]) for n in kept]
    for i, name in enumerate(mod.NOTIFY_PHASES):
        us = [(want[q, n][1] + want[q, n][2])[i] / 1000 for q, n in zip(last, kept)]
        assert rows[at + 2 + ranks + i] == f"    {name:14} {spread(us)}"
