"""What the drop-in layer needs from the library, against independent statements: the receive
budget's drop rule, the comm-free layout call, ranks with different max_tokens_per_rank, top-k
up to EPX_MAX_TOPK; and epx.compat.install's refusal to shadow a real deep_ep."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import epx
from moe_ref import make_inputs, rng

ROOT = Path(__file__).resolve().parents[2]


def budget_reference(xs, idxs, R, L, d, align, budget, ws=None):
    """Rank d's expert layout under a receive budget, straight from docs/design.md: experts
    filled in ascending order, each keeping the first pairs (source rank, token order) that fit
    whole aligned blocks. Returns (rows, probs, kept counts [L], kept {(s, t, k): row}, dropped)."""
    H = xs[0].shape[1]
    rows, probs, counts, kept, dropped = [], [], np.zeros(L, np.int32), {}, 0
    used = 0
    for l in range(L):
        pairs = [(s, t, k) for s in range(R) for t in range(xs[s].shape[0]) for k in range(idxs[s].shape[1])
                 if idxs[s][t, k] == d * L + l]
        room = max(budget - used, 0) // align * align if budget else len(pairs)
        keep = min(len(pairs), room)
        dropped += len(pairs) - keep
        counts[l] = keep
        size = (keep + align - 1) // align * align
        for i in range(size):
            if i < keep:
                s, t, k = pairs[i]
                kept[(s, t, k)] = used + i
                rows.append(xs[s][t])
                probs.append(ws[s][t, k] if ws is not None else 0.0)
            else:
                rows.append(np.zeros(H, np.float32))
                probs.append(0.0)
        used += size
    return np.array(rows, np.float32).reshape(-1, H), np.array(probs, np.float32), counts, kept, dropped


@pytest.mark.parametrize("align,budget_of", [(1, lambda r: 7 + 3 * r), (4, lambda r: 10 + 4 * r), (2, lambda r: 0)])
def test_receive_budget_drops_by_the_contract(align, budget_of):
    R, L, H, K = 3, 2, 16, 3
    E = R * L
    tokens = [int(rng(900 + align).integers(5, 14)) for _ in range(R)]
    xs, idxs, ws = make_inputs(910 + align, R, E, H, K, tokens)
    budgets = [budget_of(r) for r in range(R)]
    refs = [budget_reference(xs, idxs, R, L, d, align, budgets[d]) for d in range(R)]
    total_dropped = sum(r[4] for r in refs)
    with epx.World(nranks=R, backend="host") as world:
        def rank_fn(r):
            with world.comm(r, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=16) as c, \
                    c.handle("ht", "expert", align=align, recv_budget=budgets[r]) as h:
                res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
                # weight gradient: each row sends back its own row number + 1
                rwg = np.zeros(res.recv_x.shape[0], np.float32)
                for (s, t, k), row in refs[r][3].items():
                    rwg[row] = row + 1
                out, twg = h.combine(res.recv_x, weighted=False, row_weight_grad=rwg)
                return res, out, twg
        got = world.run(rank_fn)
    for d in range(R):
        res, _, _ = got[d]
        rows, _, counts, kept, _ = refs[d]
        assert res.recv_x.shape == rows.shape, (d, res.recv_x.shape, rows.shape)
        assert res.recv_x.tobytes() == rows.tobytes(), f"rank {d}: rows differ"
        assert np.array_equal(res.tokens_per_local_expert, counts)
        assert budgets[d] == 0 or rows.shape[0] <= budgets[d]
        assert int(res.dropped[0]) == total_dropped
    assert (total_dropped > 0) == any(budgets), "the budgets should drop something here"
    for s in range(R):
        _, out, twg = got[s]
        want_out, want_twg = budget_combine_reference(xs, idxs, R, L, s, refs)
        assert out.tobytes() == want_out.tobytes(), f"rank {s}: combine differs"
        assert np.array_equal(twg, want_twg), f"rank {s}: weight gradients differ"


def budget_combine_reference(xs, idxs, R, L, s, refs):
    """Source s's unweighted combine of its own rows sent back (each kept pair's row is its
    token's x; per destination summed in local-expert order, then over destinations), and the
    weight gradient when every row sends back its row number + 1 (0 for dropped slots)."""
    T, K = idxs[s].shape
    H = xs[s].shape[1]
    out = np.zeros((T, H), np.float32)
    twg = np.zeros((T, K), np.float32)
    for t in range(T):
        acc = np.zeros(H, np.float32)
        for d in range(R):
            if not any(idxs[s][t, k] >= 0 and idxs[s][t, k] // L == d for k in range(K)):
                continue
            part = np.zeros(H, np.float32)
            for l in range(L):  # the pairs kept on d, by local expert
                for k in range(K):
                    if idxs[s][t, k] == d * L + l and (s, t, k) in refs[d][3]:
                        part = part + xs[s][t]
            acc = acc + part
        out[t] = acc
        for k in range(K):
            e = idxs[s][t, k]
            if e >= 0 and (s, t, k) in refs[e // L][3]:
                twg[t, k] = refs[e // L][3][(s, t, k)] + 1
    return out, twg


def test_layout_counts_needs_no_comm():
    R, L, K = 4, 3, 5
    xs, idxs, _ = make_inputs(930, 1, R * L, 16, K, [23])
    idx = idxs[0]
    tpr, tpe, itr = epx.layout_counts(idx, nranks=R, num_experts=R * L)
    want_tpe = np.bincount(idx[idx >= 0], minlength=R * L)
    want_itr = np.zeros((idx.shape[0], R), bool)
    for t in range(idx.shape[0]):
        for e in idx[t][idx[t] >= 0]:
            want_itr[t, e // L] = True
    assert np.array_equal(tpe, want_tpe) and np.array_equal(itr, want_itr)
    assert np.array_equal(tpr, want_itr.sum(0))
    bad = idx.copy()
    bad[0, 0] = R * L
    with pytest.raises(epx.ExpertOutOfRangeError):
        epx.layout_counts(bad, nranks=R, num_experts=R * L)
    with pytest.raises(epx.ExpertsNotDivisibleError):
        epx.layout_counts(idx, nranks=R, num_experts=R * L + 1)


def test_ranks_may_pass_different_max_tokens():
    with epx.World(nranks=3, backend="host") as world:
        def rank_fn(r):
            with world.comm(r, num_experts=6, hidden=16, topk=2, max_tokens_per_rank=10 + 5 * r) as c:
                return c.config.max_tokens_per_rank
        assert world.run(rank_fn) == [20, 20, 20]


def test_topk_up_to_the_limit():
    assert epx.MAX_TOPK == 32
    R, L, H, K = 2, 20, 16, 32
    xs, idxs, ws = make_inputs(940, R, R * L, H, K, [9, 6], none_frac=0.3)
    with epx.World(nranks=R, backend="host") as world:
        def rank_fn(r):
            with world.comm(r, num_experts=R * L, hidden=H, topk=K) as c, c.handle("ht", "token") as h:
                res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
                return h.combine(res.recv_x)
        outs = world.run(rank_fn)
    for s in range(R):  # every token comes back once per destination rank it chose
        for t in range(xs[s].shape[0]):
            n = len({int(e) // L for e in idxs[s][t] if e >= 0})
            acc = np.float32(0) * xs[s][t]
            for _ in range(n):
                acc = acc + xs[s][t]
            assert outs[s][t].tobytes() == acc.astype(np.float32).tobytes()


def _run_py(code, tmp_path, extra_path=None):
    env_path = [str(ROOT / "python")] + ([str(extra_path)] if extra_path else [])
    src = "import sys; sys.path[:0] = %r\n" % env_path + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_install_resolves_deep_ep(tmp_path):
    pytest.importorskip("torch")
    r = _run_py("""
        import epx.compat
        mod = epx.compat.install()
        import deep_ep
        from deep_ep import Buffer, HybridEPBuffer, Config
        from deep_ep.utils import EventHandle, EventOverlap
        assert deep_ep is mod and epx.compat.installed()
        EventOverlap(EventHandle()).current_stream_wait()
        c = Buffer.get_dispatch_config(4)
        assert c.get_nvl_buffer_size_hint(4096, 4) > 0 and c.get_rdma_buffer_size_hint(4096, 4) == 0
        epx.compat.uninstall()
        assert not epx.compat.installed()
        print("ok")
    """, tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_install_refuses_to_shadow_a_real_deep_ep(tmp_path):
    pytest.importorskip("torch")
    fake = tmp_path / "site"
    (fake / "deep_ep").mkdir(parents=True)
    (fake / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    r = _run_py("""
        import epx.compat
        try:
            epx.compat.install()
        except RuntimeError as e:
            assert "real deep_ep" in str(e) and "force=True" in str(e), e
            print("refused")
        epx.compat.install(force=True)
        import deep_ep
        assert not hasattr(deep_ep, "REAL")
        print("forced")
    """, tmp_path, extra_path=fake)
    assert r.returncode == 0 and "refused" in r.stdout and "forced" in r.stdout, r.stderr


def test_hybrid_ep_buffer_budget_over_gloo():
    """HybridEPBuffer's non_blocking receive budget across processes: x has exactly the
    budget's rows, the kept pairs are the contract's, handle[-1] flags the drop on every rank,
    combine and the dense probability gradient skip the dropped pairs."""
    pytest.importorskip("torch")
    import deep_ep_worker
    from spawn_ranks import free_port, spawn_ranks

    R, L, H, K, align = 2, 2, 16, 2, 2
    tokens = [int(rng(960).integers(8, 16)) for _ in range(R)]
    xs, idxs, ws = make_inputs(961, R, R * L, H, K, tokens)
    budgets = [6, 10]
    refs = [budget_reference(xs, idxs, R, L, d, align, budgets[d], ws) for d in range(R)]
    dropped = sum(r[4] for r in refs)
    port = free_port()
    got = spawn_ranks(deep_ep_worker.budget_worker,
                      [(r, R, port, (xs[r], idxs[r], ws[r], R * L, L, align, budgets[r])) for r in range(R)], 180)
    for d in range(R):
        x, probs, tpe, flag, out, pgrad = got[d]
        rows, rprobs, counts, kept, _ = refs[d]
        want = np.zeros((budgets[d], H), np.float32)
        want[:rows.shape[0]] = rows
        assert x.tobytes() == want.tobytes(), f"rank {d}: rows differ"
        wp = np.zeros(budgets[d], np.float32)
        wp[:rprobs.shape[0]] = rprobs
        assert np.array_equal(probs, wp)
        assert np.array_equal(tpe, (counts + align - 1) // align * align)
        assert flag == dropped and dropped > 0
        want_out, want_twg = budget_combine_reference(xs, idxs, R, L, d, refs)
        assert out.tobytes() == want_out.tobytes(), f"rank {d}: combine differs"
        dense = np.zeros((tokens[d], R * L), np.float32)
        for t in range(tokens[d]):
            for k in range(K):
                if idxs[d][t, k] >= 0:
                    dense[t, idxs[d][t, k]] += want_twg[t, k]
        assert np.array_equal(pgrad, dense), f"rank {d}: probability gradients differ"


def test_low_latency_dispatch_and_combine_over_gloo():
    """DeepEP's low-latency calls on epx's low-latency path: recv [L, R * M, H] with each
    expert's rows first in (source rank, token) order and counts [L]; combine weighted by the
    weights given to combine, by the contract's arithmetic (bf16 partials per destination in
    local-expert order, float32 sums of rounded products, then over ranks)."""
    torch = pytest.importorskip("torch")
    import deep_ep_worker
    from spawn_ranks import free_port, spawn_ranks

    R, L, H, K, M = 2, 3, 32, 3, 12
    E = R * L
    tokens = [int(rng(970).integers(1, M + 1)) for _ in range(R)]
    xs, idxs, ws = make_inputs(971, R, E, H, K, tokens)
    bf = [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in xs]  # what dispatch moves
    port = free_port()
    got = spawn_ranks(deep_ep_worker.low_latency_worker, [(r, R, port, (xs[r], idxs[r], ws[r], E, M)) for r in range(R)],
                      180)
    from moe_ref import expected_expert_layout

    def bf16(a):
        return torch.tensor(a, dtype=torch.float32).to(torch.bfloat16).float().numpy()

    for d in range(R):
        recv, count, _ = got[d]
        rows, _, counts, _ = expected_expert_layout(bf, idxs, ws, R, L, d, ll_block=R * M)
        assert np.array_equal(count, counts)
        for l in range(L):
            want = rows.reshape(L, R * M, H)[l, :counts[l]]
            assert recv[l, :counts[l]].tobytes() == want.tobytes(), f"rank {d} expert {l}: rows differ"
    for s in range(R):
        out = got[s][2]
        for t in range(tokens[s]):
            acc = np.zeros(H, np.float32)
            for d in range(R):
                slots = sorted((int(e), k) for k, e in enumerate(idxs[s][t]) if e >= 0 and e // L == d)
                if not slots:
                    continue
                part = np.zeros(H, np.float32)
                for e, k in slots:  # ascending local expert
                    y = bf16(bf[s][t] * np.float32(e + 1))
                    part = part + np.float32(ws[s][t, k]) * y
                acc = acc + bf16(part)
            assert out[t].tobytes() == bf16(acc).tobytes(), f"rank {s} token {t}: combine differs"


def test_plans_live_until_the_framework_drops_them(tmp_path):
    """Every dispatch holds its own plan (many layers in flight), and a plan the framework
    drops is freed at a later operation: the open plans follow what is held."""
    pytest.importorskip("torch")
    r = _run_py("""
        import os, gc, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(%d))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from epx.compat.deep_ep import Buffer
        from epx.compat.deep_ep import _runtime
        buf = Buffer(dist.group.WORLD, 0, 0)
        x, idx = torch.randn(6, 16), torch.tensor([[0, 1]] * 6)
        w = torch.rand(6, 2)

        def layer():
            tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, 2)
            out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=tpr, is_token_in_rank=itr,
                               num_tokens_per_expert=tpe)
            return out[4]

        held = [layer() for _ in range(5)]          # five layers in flight
        comm = next(iter(_runtime._comms.values()))
        assert comm._open_handles == 5, comm._open_handles
        for h in held:                               # each layer's backward: combine, then drop
            y, _, _ = buf.combine(x, h)
            assert torch.equal(y, x)                 # one destination rank: the rows come back as sent
        held = h = None
        gc.collect()
        layer()                                      # the next operation frees what was dropped
        assert comm._open_handles == 1, comm._open_handles
        print("ok")
    """ % _free_port(), tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def _free_port():
    from spawn_ranks import free_port

    return free_port()
