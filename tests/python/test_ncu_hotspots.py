"""tools/ncu_hotspots.py on a source page in Nsight Compute's CSV form (made up here, with the
columns ncu writes): runs of equally executed instructions, their shares and stall reasons,
and a file holding two kernels."""

import csv
import io

from moe_ref import rng
from tool_module import load_tool

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "stall_long_sb", "stall_short_sb", "stall_long_sb (Not Issued)"]


def _tool():
    return load_tool("ncu_hotspots")


def _page(kernels):
    """kernels: name -> [(source, executed, long_sb, short_sb)]; samples are the two stalls' sum."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    for name, code in kernels.items():
        w.writerow(["Kernel Name", name])
        w.writerow(HEADER)
        for i, (src, ex, lsb, ssb) in enumerate(code):
            w.writerow([hex(0x1000 + 16 * i), "  " + src, lsb + ssb, lsb + ssb, lsb + ssb, f"{ex:,}", lsb, ssb, 99])
    return out.getvalue()


def _random_kernel(g):
    """A prologue run once, a loop body run n times, an epilogue: (code, n, body length)."""
    n, body = int(g.integers(2, 500)), int(g.integers(2, 10))
    stall = lambda: int(g.integers(0, 51))
    code = [("LDC R1, c[0x0][0x28]", 1, 0, 0), ("S2R R0, SR_TID.X", 1, int(g.integers(0, 4)), 0)]
    code += [(f"FFMA R{i}, R{i}, R{i}, R{i}", n, stall(), stall()) for i in range(body)]
    code += [("EXIT", 1, 0, 1)]
    return code, n, body


def test_runs_shares_and_stalls():
    mod = _tool()
    code, n, body = _random_kernel(rng(0))
    (kernel,) = mod.read_kernels(io.StringIO(_page({"k(int)": code})))
    assert kernel.name == "k(int)" and len(kernel.code) == len(code)
    runs = mod.runs_of(kernel.code)
    assert [(r.first, r.last, r.executed) for r in runs] == [(0, 1, 1), (2, 1 + body, n), (2 + body, 2 + body, 1)]
    loop = runs[1]
    assert loop.instructions == n * body
    assert loop.samples == sum(c[2] + c[3] for c in code[2:2 + body])
    assert loop.stalls == {"long_sb": sum(c[2] for c in code[2:2 + body]), "short_sb": sum(c[3] for c in code[2:2 + body])}
    text = mod.report(kernel, top=5, min_share=0.0)
    share = 100.0 * n * body / (n * body + 3)
    assert f"{share:6.1f}" in text.splitlines()[5] and "FFMA R0" in text.splitlines()[5]
    assert "long_sb (Not Issued)" not in text


def test_two_kernels_and_an_empty_file(tmp_path, capsys):
    mod = _tool()
    g = rng(1)
    page = _page({"a()": _random_kernel(g)[0], "b()": _random_kernel(g)[0]})
    path = tmp_path / "page.csv"
    path.write_text(page)
    assert [k.name for k in mod.read_kernels(io.StringIO(page))] == ["a()", "b()"]
    assert mod.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "kernel a()" in out and "kernel b()" in out
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== nothing profiled\n")
    assert mod.main([str(empty)]) == 2
