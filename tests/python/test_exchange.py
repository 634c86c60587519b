"""Dispatch and combine through the numpy API on the CPU backend, against an independent
numpy reference (moe_ref.py): exact where the contract makes the result exact (dispatch row
contents, combine in the contract's float32 order), rtol 1e-5 against the dense float64 MoE."""

import numpy as np
import pytest

import epx
from moe_ref import (
    Experts,
    canonical_topk,
    dense_moe,
    expected_expert_layout,
    expected_token_layout,
    f32_round_bf16,
    make_inputs,
    rng,
    to_map,
)

R, E, H, K = 4, 8, 32, 3
L = E // R
TOKENS = [5, 0, 7, 3]  # rank 1 sends nothing
M = 8  # max_tokens_per_rank
CFG = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=M, timeout_ms=20000)


def routing_kwargs(form, idx, w, idx_dtype=np.int64):
    if form == "topk":
        return dict(topk_idx=idx.astype(idx_dtype), topk_weights=w)
    m, p = to_map(idx, w, E)
    return dict(routing_map=m, probs=p)


def effective_routing(form, idxs, ws):
    """The routing epx acts on: the map form reorders slots by ascending expert id."""
    if form == "topk":
        return idxs, ws
    out = [canonical_topk(*to_map(i, w, E), K) for i, w in zip(idxs, ws)]
    return [o[0] for o in out], [o[1] for o in out]


def contract_token_combine(ys_by_rank, srcs_by_rank, T_list):
    """out[s][t] = sum over destination ranks ascending of y_d[row], float32 left to right."""
    outs = [np.zeros((T, H), np.float32) for T in T_list]
    for d in range(R):
        for n, (s, t) in enumerate(srcs_by_rank[d]):
            outs[s][t] = outs[s][t] + ys_by_rank[d][n]
    return outs


def contract_expert_combine(ys_by_rank, probs_by_rank, keys_by_rank, T_list, weighted=True, round_partial=None):
    """Destination: partial = sum over local experts ascending of fl32(p * y); source: sum of
    partials over destination ranks ascending."""
    outs = [np.zeros((T, H), np.float32) for T in T_list]
    for d in range(R):
        partial = {}
        for row, s, t, k, l in sorted(keys_by_rank[d], key=lambda q: (q[1], q[2], q[4])):
            p = probs_by_rank[d][row] if weighted else np.float32(1.0)
            term = (np.float32(p) * ys_by_rank[d][row]).astype(np.float32)
            partial[(s, t)] = (partial.get((s, t), np.zeros(H, np.float32)) + term).astype(np.float32)
        for (s, t), v in partial.items():
            if round_partial is not None:
                v = round_partial(v)
            outs[s][t] = outs[s][t] + v
    return outs


# ---- token layout -----------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["ht", "alltoall"])
@pytest.mark.parametrize("form,idx_dtype", [("topk", np.int32), ("topk", np.int64), ("map", None)])
def test_token_layout_moe(world4, algo, form, idx_dtype):
    xs, idxs, ws = make_inputs(1, R, E, H, K, TOKENS)
    f = Experts(1, E, H)
    eidx, ew = effective_routing(form, idxs, ws)

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle(algo, "token") as h:
            res = h.dispatch(xs[r], **routing_kwargs(form, idxs[r], ws[r], idx_dtype))
            y = np.zeros_like(res.recv_x)
            for n in range(res.recv_x.shape[0]):
                for k in range(K):
                    l = res.recv_topk_idx[n, k]
                    if l >= 0:
                        y[n] += res.recv_topk_weights[n, k] * f(r * L + l, res.recv_x[n])
            return res, y, h.combine(y), h.info()

    got = world4.run(rank)
    srcs, ys = [], []
    for d in range(R):
        res, y, _, info = got[d]
        ex, eri, erw, counts, src = expected_token_layout(xs, eidx, ew, R, L, d)
        np.testing.assert_array_equal(res.recv_x, ex)  # dispatch is a copy: exact
        np.testing.assert_array_equal(res.recv_topk_idx, eri)
        np.testing.assert_array_equal(res.recv_topk_weights, erw)
        np.testing.assert_array_equal(res.tokens_per_local_expert, counts)
        assert res.num_rows == len(src) == info.num_recv_tokens == info.num_recv_rows
        assert info.num_send_tokens == TOKENS[d]
        assert info.num_recv_pairs == counts.sum()
        srcs.append(src)
        ys.append(y)
    want_dense = dense_moe(xs, idxs, ws, f)
    want_exact = contract_token_combine(ys, srcs, TOKENS)
    for r in range(R):
        out = got[r][2]
        assert out.shape == (TOKENS[r], H) and out.dtype == np.float32
        np.testing.assert_array_equal(out, want_exact[r])
        np.testing.assert_allclose(out, want_dense[r], rtol=1e-5, atol=1e-5)


# ---- expert layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("form", ["topk", "map"])
def test_expert_layout_moe(world4, align, form):
    xs, idxs, ws = make_inputs(2, R, E, H, K, TOKENS)
    f = Experts(2, E, H)
    eidx, ew = effective_routing(form, idxs, ws)

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", "expert", align=align) as h:
            res = h.dispatch(xs[r], **routing_kwargs(form, idxs[r], ws[r]))
            y = np.full_like(res.recv_x, np.nan)  # padding rows must never be read
            start = 0
            for l in range(L):
                c = int(res.tokens_per_local_expert[l])
                y[start:start + c] = f(r * L + l, res.recv_x[start:start + c])
                start += (c + align - 1) // align * align
            return res, y, h.combine(y)

    got = world4.run(rank)
    ys, probs, keys = [], [], []
    for d in range(R):
        res, y, _ = got[d]
        ex, ep, counts, kk = expected_expert_layout(xs, eidx, ew, R, L, d, align=align)
        np.testing.assert_array_equal(res.recv_x, ex)
        np.testing.assert_array_equal(res.recv_probs, ep)
        np.testing.assert_array_equal(res.tokens_per_local_expert, counts)
        np.testing.assert_array_equal(res.tokens_per_expert_padded, (counts + align - 1) // align * align)
        assert res.recv_topk_idx is None and res.recv_topk_weights is None
        ys.append(y)
        probs.append(res.recv_probs)
        keys.append(kk)
    want_dense = dense_moe(xs, idxs, ws, f)
    want_exact = contract_expert_combine(ys, probs, keys, TOKENS)
    for r in range(R):
        np.testing.assert_array_equal(got[r][2], want_exact[r])
        np.testing.assert_allclose(got[r][2], want_dense[r], rtol=1e-5, atol=1e-5)


def test_expert_layout_unweighted_and_row_probs(world4):
    xs, idxs, ws = make_inputs(3, R, E, H, K, TOKENS)
    g = rng(1003)
    qs = [None] * R

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", "expert", align=2) as h:
            res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
            y = (res.recv_x * 2).astype(np.float32)
            q = rng_q[r]
            return res, y, h.combine(y, weighted=False), h.combine(y, row_probs=q[: y.shape[0]])

    # row_probs override: fixed per rank, drawn before the threads start
    rng_q = [g.uniform(0, 1, 64).astype(np.float32) for _ in range(R)]
    got = world4.run(rank)
    ys, keys = [], []
    for d in range(R):
        _, _, _, kk = expected_expert_layout(xs, idxs, ws, R, L, d, align=2)
        ys.append(got[d][1])
        keys.append(kk)
        qs[d] = rng_q[d]
    unweighted = contract_expert_combine(ys, [None] * R, keys, TOKENS, weighted=False)
    overridden = contract_expert_combine(ys, qs, keys, TOKENS)
    for r in range(R):
        np.testing.assert_array_equal(got[r][2], unweighted[r])
        np.testing.assert_array_equal(got[r][3], overridden[r])


# ---- low-latency --------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["topk", "map"])
def test_low_latency_moe(world4, form):
    xs, idxs, ws = make_inputs(4, R, E, H, K, TOKENS)
    f = Experts(4, E, H)
    eidx, ew = effective_routing(form, idxs, ws)

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ll") as h:
            assert h.layout == "expert" and h.ll_rows == R * M
            outs = []
            for it in range(2):  # re-planned: the fixed buffers are reused shapes
                res = h.dispatch(xs[r], **routing_kwargs(form, idxs[r], ws[r]))
                y = np.full_like(res.recv_x, np.nan)  # rows past the counts must never be read
                for l in range(L):
                    c = int(res.tokens_per_local_expert[l])
                    y[l, :c] = f(r * L + l, res.recv_x[l, :c])
                outs.append(h.combine(y))
            return res, y, outs

    got = world4.run(rank)
    ys, probs, keys = [], [], []
    for d in range(R):
        res, y, _ = got[d]
        assert res.recv_x.shape == (L, R * M, H)
        assert res.recv_probs.shape == (L, R * M)
        ex, ep, counts, kk = expected_expert_layout(xs, eidx, ew, R, L, d, ll_block=R * M)
        np.testing.assert_array_equal(res.recv_x.reshape(-1, H), ex)  # rows past counts: zeros (fresh buffer)
        np.testing.assert_array_equal(res.recv_probs.reshape(-1), ep)
        np.testing.assert_array_equal(res.tokens_per_local_expert, counts)
        assert res.num_rows == counts.sum()
        ys.append(y.reshape(-1, H))
        probs.append(res.recv_probs.reshape(-1))
        keys.append(kk)
    want_dense = dense_moe(xs, idxs, ws, f)
    want_exact = contract_expert_combine(ys, probs, keys, TOKENS)
    for r in range(R):
        for out in got[r][2]:
            np.testing.assert_array_equal(out, want_exact[r])
            np.testing.assert_allclose(out, want_dense[r], rtol=1e-5, atol=1e-5)


def test_low_latency_preallocated_buffer(world2):
    R2, E2 = 2, 4
    xs, idxs, ws = make_inputs(5, R2, E2, H, 2, [3, 4])
    cfg = dict(num_experts=E2, hidden=H, topk=2, max_tokens_per_rank=4, timeout_ms=20000)

    def rank(r):
        with world2.comm(r, **cfg) as comm, comm.handle("ll") as h:
            buf = np.full((2, R2 * 4, H), -7.0, np.float32)
            res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r], recv_x=buf)
            assert res.recv_x is buf
            return buf.copy(), res.tokens_per_local_expert.copy()

    for d, (buf, counts) in enumerate(world2.run(rank)):
        ex, _, ecounts, _ = expected_expert_layout(xs, idxs, ws, R2, 2, d, ll_block=R2 * 4)
        np.testing.assert_array_equal(counts, ecounts)
        for l in range(2):
            c = counts[l]
            np.testing.assert_array_equal(buf[l, :c], ex.reshape(2, -1, H)[l, :c])
            assert (buf[l, c:] == -7.0).all()  # "rows past the count are left as they were"


# ---- replay, scaling, weight gradients ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["token", "expert"])
def test_replay_and_weight_grad_routing(world4, layout):
    xs, idxs, ws = make_inputs(6, R, E, H, K, TOKENS)
    gs = [rng(60 + r).uniform(-1, 1, (TOKENS[r], H)).astype(np.float32) for r in range(R)]

    def code(s, t, k):
        return np.float32(s * 1000 + t * 10 + k + 1)

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", layout, align=3) as h:
            res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
            pid = h.plan_id
            again = h.dispatch(gs[r])  # replay with new data: no routing, same plan
            assert h.plan_id == pid
            scaled = h.dispatch(gs[r], scale_by_probs=True) if layout == "expert" else None
            # weight gradients: a code per received slot, sent back to the source's topk slots
            if layout == "token":
                _, _, _, _, src = expected_token_layout(xs, idxs, ws, R, L, r)
                rwg = np.full((len(src), K), 5555.0, np.float32)
                for n, (s, t) in enumerate(src):
                    for k in range(K):
                        rwg[n, k] = code(s, t, k)
            else:
                _, _, _, keys = expected_expert_layout(xs, idxs, ws, R, L, r, align=3)
                rwg = np.full(res.recv_x.shape[0], 5555.0, np.float32)  # padding rows: never read
                for row, s, t, k, l in keys:
                    rwg[row] = code(s, t, k)
            y = np.zeros_like(res.recv_x)
            out, twg = h.combine(y, row_weight_grad=rwg)
            return res, again, scaled, twg

    got = world4.run(rank)
    for d in range(R):
        res, again, scaled, _ = got[d]
        if layout == "token":
            ex, *_ = expected_token_layout(gs, idxs, ws, R, L, d)
            np.testing.assert_array_equal(again.recv_x, ex)
        else:
            ex, ep, _, keys = expected_expert_layout(gs, idxs, ws, R, L, d, align=3)
            np.testing.assert_array_equal(again.recv_x, ex)
            np.testing.assert_array_equal(scaled.recv_x, (ep[:, None] * ex).astype(np.float32))
    for s in range(R):
        twg = got[s][3]
        assert twg.shape == (TOKENS[s], K)
        for t in range(TOKENS[s]):
            for k in range(K):
                want = code(s, t, k) if idxs[s][t, k] >= 0 else 0.0
                assert twg[t, k] == want, (s, t, k)


def test_preallocated_recv_with_spare_capacity(world4):
    xs, idxs, ws = make_inputs(7, R, E, H, K, TOKENS)

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", "token") as h:
            buf = np.zeros((64, H), np.float32)
            res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r], recv_x=buf)
            assert np.shares_memory(res.recv_x, buf)
            return res, h.combine(buf)  # a y with spare rows is fine: only the plan's rows are read

    got = world4.run(rank)
    ys, srcs = [], []
    for d, (res, _) in enumerate(got):
        ex, eri, erw, counts, src = expected_token_layout(xs, idxs, ws, R, L, d)
        assert res.num_rows == len(src) and res.recv_x.shape == ex.shape  # trimmed to the rows written
        np.testing.assert_array_equal(res.recv_x, ex)
        np.testing.assert_array_equal(res.recv_topk_idx, eri)
        np.testing.assert_array_equal(res.recv_topk_weights, erw)
        ys.append(ex)
        srcs.append(src)
    want = contract_token_combine(ys, srcs, TOKENS)
    for r in range(R):
        np.testing.assert_array_equal(got[r][1], want[r])


def test_replans_on_one_handle(world2):
    cfg = dict(num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, timeout_ms=20000)

    def rank(r):
        with world2.comm(r, **cfg) as comm, comm.handle("ht", "token") as h:
            seen = []
            for it in range(3):
                xs, idxs, ws = make_inputs(100 + it, 2, 4, 16, 2, [3 + it, 2 * it])
                res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
                seen.append((h.plan_id, res.recv_x.copy(), xs, idxs, ws))
            return seen

    got = world2.run(rank)
    for d in range(2):
        for it, (pid, rx, xs, idxs, ws) in enumerate(got[d]):
            assert pid == it + 1
            ex, *_ = expected_token_layout(xs, idxs, ws, 2, 2, d)
            np.testing.assert_array_equal(rx, ex)


# ---- layout and info ------------------------------------------------------------------------------


def test_layout_counts(world4):
    xs, idxs, ws = make_inputs(8, R, E, H, K, TOKENS)

    def rank(r):
        with world4.comm(r, **CFG) as comm:
            a = comm.layout(topk_idx=idxs[r], topk_weights=ws[r])
            m, p = to_map(idxs[r], ws[r], E)
            b = comm.layout(routing_map=m, probs=p)
            return a, b

    for r, (a, b) in enumerate(world4.run(rank)):
        idx = idxs[r]
        in_rank = np.zeros((TOKENS[r], R), bool)
        per_exp = np.zeros(E, np.int32)
        for t in range(TOKENS[r]):
            for e in idx[t]:
                if e >= 0:
                    in_rank[t, e // L] = True
                    per_exp[e] += 1
        for lay in (a, b):
            np.testing.assert_array_equal(lay.is_token_in_rank, in_rank)
            np.testing.assert_array_equal(lay.tokens_per_rank, in_rank.sum(0))
            np.testing.assert_array_equal(lay.tokens_per_expert, per_exp)
            assert lay.is_token_in_rank.dtype == np.bool_


def test_info_sent_copies(world4):
    xs, idxs, ws = make_inputs(9, R, E, H, K, TOKENS)

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", "expert", align=4) as h:
            h.notify(topk_idx=idxs[r], topk_weights=ws[r])
            return h.info()

    for r, info in enumerate(world4.run(rank)):
        copies = sum(len({int(e) // L for e in idxs[r][t] if e >= 0}) for t in range(TOKENS[r]))
        assert info.num_sent_copies == copies
        _, _, counts, _ = expected_expert_layout(xs, idxs, ws, R, L, r, align=4)
        np.testing.assert_array_equal(info.tokens_per_local_expert, counts)
        assert info.num_recv_pairs == counts.sum()
        assert info.num_recv_rows == ((counts + 3) // 4 * 4).sum()


# ---- bf16 and fp8 ---------------------------------------------------------------------------------


def _bf16_inputs(kind, xs):
    bits = [epx.float32_to_bf16_bits(x) for x in xs]
    if kind == "uint16":
        return bits
    ml = pytest.importorskip("ml_dtypes")
    return [b.view(ml.bfloat16) for b in bits]


@pytest.mark.parametrize("kind", ["uint16", "ml_dtypes"])
@pytest.mark.parametrize("layout", ["token", "expert"])
def test_bf16_dispatch_combine_bits(world4, kind, layout):
    xs, idxs, ws = make_inputs(10, R, E, H, K, TOKENS)
    xb = _bf16_inputs(kind, xs)
    xf = [epx.bf16_bits_to_float32(b) for b in xb]  # the values bf16 holds

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", layout) as h:
            res = h.dispatch(xb[r], topk_idx=idxs[r], topk_weights=ws[r])
            assert res.recv_x.dtype == xb[r].dtype
            return res, h.combine(res.recv_x), h.combine(res.recv_x, out_dtype="float32")

    got = world4.run(rank)
    ys, srcs, probs, keys = [], [], [], []
    for d in range(R):
        res = got[d][0]
        if layout == "token":
            ex, _, _, _, src = expected_token_layout(xf, idxs, ws, R, L, d)
            srcs.append(src)
        else:
            ex, ep, _, kk = expected_expert_layout(xf, idxs, ws, R, L, d)
            probs.append(ep)
            keys.append(kk)
        np.testing.assert_array_equal(epx.bf16_bits_to_float32(res.recv_x), ex)
        ys.append(epx.bf16_bits_to_float32(res.recv_x))
    if layout == "token":
        want32 = contract_token_combine(ys, srcs, TOKENS)
    else:
        want32 = contract_expert_combine(ys, probs, keys, TOKENS, round_partial=f32_round_bf16)
    for r in range(R):
        out_bf16, out_f32 = got[r][1], got[r][2]
        assert out_bf16.dtype == xb[r].dtype and out_f32.dtype == np.float32
        np.testing.assert_array_equal(epx.bf16_bits_to_float32(out_bf16), f32_round_bf16(want32[r]))
        np.testing.assert_array_equal(out_f32, want32[r])


def test_fp8_dispatch(world2):
    H8 = 160  # one full block of 128 channels and a partial one
    cfg = dict(num_experts=4, hidden=H8, topk=2, max_tokens_per_rank=8, timeout_ms=20000)
    xs, idxs, ws = make_inputs(11, 2, 4, H8, 2, [4, 3])
    xs[0][1, :128] *= 1000  # a large block, saturating nothing (scales follow amax)
    xs[1][0, 128:] = 0  # an all-zero partial block: a = 1e-4

    def rank(r):
        with world2.comm(r, **cfg) as comm, comm.handle("ht", "token") as h:
            return h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r], recv_dtype="fp8")

    for d, res in enumerate(world2.run(rank)):
        ex, *_ = expected_token_layout(xs, idxs, ws, 2, 2, d)
        assert res.recv_scales.shape == (ex.shape[0], 2)
        # the contract's quantisation, written here with numpy (+ ml_dtypes for e4m3 rounding)
        want_q, want_s = _quantize_ref(ex)
        np.testing.assert_array_equal(res.recv_scales, want_s)
        if want_q is not None:
            np.testing.assert_array_equal(np.asarray(res.recv_x).view(np.uint8), want_q)
        q, s = epx.quantize_e4m3(ex)
        np.testing.assert_array_equal(np.asarray(res.recv_x).view(np.uint8), q)
        # dequantised: within half an e4m3 step of x (relative 2^-4), or, among e4m3's
        # subnormals, within a subnormal step of the block's scale (2^-9 times it)
        deq = np.asarray(epx.dequantize_e4m3(res.recv_x, res.recv_scales), dtype=np.float64)
        step = np.repeat(np.asarray(res.recv_scales, dtype=np.float64), 128, axis=1)[:, :H8] * 2.0 ** -9
        err = np.abs(deq - ex)
        assert np.all(err <= np.abs(ex) * 2.0 ** -4 + step), \
            f"rank {d}: dequantised rows off by up to {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


def _quantize_ref(rows):
    n, h = rows.shape
    blocks = (h + 127) // 128
    scales = np.zeros((n, blocks), np.float32)
    scaled = np.zeros_like(rows)
    for b in range(blocks):
        blk = rows[:, b * 128:(b + 1) * 128]
        a = np.maximum(np.abs(blk).max(axis=1), np.float32(1e-4)).astype(np.float32)
        scales[:, b] = a / np.float32(448.0)
        scaled[:, b * 128:(b + 1) * 128] = blk * (np.float32(448.0) / a)[:, None]
    try:
        import ml_dtypes
    except ImportError:
        return None, scales
    q = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return q, scales


# ---- routing conversions ----------------------------------------------------------------------------


def test_map_topk_roundtrip():
    _, idxs, ws = make_inputs(12, 1, 16, 4, 4, [20])
    idx, w = idxs[0], ws[0]
    m, p = epx.topk_to_map(idx, w, num_experts=16)
    wm, wp = to_map(idx, w, 16)
    np.testing.assert_array_equal(m, wm)
    np.testing.assert_array_equal(p, wp)
    i2, w2 = epx.map_to_topk(m, p, topk=4)
    ci, cw = canonical_topk(wm, wp, 4)
    np.testing.assert_array_equal(i2, ci)
    np.testing.assert_array_equal(w2, cw)
    assert i2.dtype == np.int32 and w2.dtype == np.float32
    i3, w3 = epx.map_to_topk(m, None, topk=5)  # no probs: weight 1; wider than needed: padded
    assert (i3[:, 4] == -1).all() and set(np.unique(w3)) <= {0.0, 1.0}


def test_sync_free_handle_on_host_sizes_exactly(world4):
    """exact=False only matters on CUDA: the CPU backend always knows the counts, so outputs are
    still sized exactly, also past max_tokens_per_rank."""
    xs, idxs, ws = make_inputs(13, R, E, H, K, TOKENS)

    def rank(r):
        with world4.comm(r, **dict(CFG, max_tokens_per_rank=1)) as comm, \
                comm.handle("ht", "token", exact=False) as h:
            return h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])

    for d, res in enumerate(world4.run(rank)):
        ex, *_ = expected_token_layout(xs, idxs, ws, R, L, d)
        np.testing.assert_array_equal(res.recv_x, ex)
