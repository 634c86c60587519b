"""A rank whose arguments fail the Python checks (shape, dtype) while its peers pass good ones:
it still takes part in the collective it refused, so every rank fails at once, well inside the
timeout (the refusing rank with its ShapeError / DTypeError and the Python message, its peers
with an epx.Error naming it), and the comm works afterwards, against the numpy reference."""

import re
import time
import traceback

import numpy as np
import pytest

import epx
from moe_ref import Experts, dense_moe, expected_expert_layout, make_inputs, rng

R, E, H, K = 4, 8, 32, 2
L = E // R
TIMEOUT_MS = 6000
CFG = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=8, timeout_ms=TIMEOUT_MS)
TOKENS = [5, 3, 6, 4]

# the call under test: the argument the refusing rank gets wrong in it, and the C call its
# peers make first, which the refusal must be (a backend that compares operations on the
# device, as CUDA does, would find any other one out of step)
OPS = {
    "dispatch": ("x", "epx_notify"),  # with a routing: plans in a notify, then dispatches
    "dispatch_into": ("x", "epx_dispatch with a routing"),  # into the caller's recv_x: one C call
    "replay": ("x", "epx_dispatch"),  # without a routing: the last plan again (combine's gradient)
    "notify": ("topk_idx", "epx_notify"),
    "combine": ("y", "epx_combine"),
    "fp8_scales": ("recv_scales", "epx_dispatch"),  # found wrong once every rank has planned
}


def _bad_float(kind, a):
    """A wrongly shaped (one column short) or wrongly typed (float64) copy of a float array."""
    return np.ascontiguousarray(a[:, :-1]) if kind == "shape" else a.astype(np.float64)


def _bad_idx(kind, idx):
    return np.ascontiguousarray(idx[:, :-1]) if kind == "shape" else idx.astype(np.float32)


def _call(op, kind, bad, h, prior, x, idx, w, rows):
    """Runs ``op`` on one rank: wrong arguments on the refusing rank (``bad``), good ones on
    its peers. ``prior``: the dispatch made before; ``rows``: the rows that arrive on this rank
    (the reference's count)."""
    if op == "notify":
        return h.notify(topk_idx=_bad_idx(kind, idx) if bad else idx, topk_weights=w)
    if op == "combine":
        y = prior.recv_x
        return h.combine(_bad_float(kind, y) if bad else y)
    if op == "fp8_scales":
        scales = None
        if bad:  # the plan is made before the given scales can be checked against its rows
            scales = np.zeros((rows + 1, 1), np.float32) if kind == "shape" else np.zeros((rows, 1), np.float64)
        return h.dispatch(x, topk_idx=idx, topk_weights=w, recv_dtype="fp8", recv_scales=scales)
    x = _bad_float(kind, x) if bad else x
    if op == "replay":
        return h.dispatch(x)
    recv_x = np.zeros((rows + 3, H), np.float32) if op == "dispatch_into" else None
    return h.dispatch(x, topk_idx=idx, topk_weights=w, recv_x=recv_x)


def _moe_layer(h, r, x, idx, w, experts):
    """A correct dispatch, the stand-in experts on each local block, and the combine."""
    res = h.dispatch(x, topk_idx=idx, topk_weights=w)
    y, start = np.zeros_like(res.recv_x), 0
    for l, c in enumerate(res.tokens_per_local_expert):
        y[start:start + c] = experts(r * L + l, res.recv_x[start:start + c])
        start += c
    return res.recv_x, h.combine(y)


def _rank(make_comm, r, op, kind, bad_rank, inputs, seed):
    """One rank (``make_comm(r)`` opens its comm): the refused call (timed), then a correct
    layer on the same comm and handle. Returns (what the call raised, or None; seconds it
    took; recv_x; out)."""
    xs, idxs, ws = inputs
    ex, *_ = expected_expert_layout(xs, idxs, ws, R, L, r)
    with make_comm(r) as comm, comm.handle("ht", "expert") as h:
        prior = None
        if op in ("replay", "combine"):  # a plan to replay, rows to combine
            prior = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
        t0 = time.monotonic()
        err = None
        try:
            _call(op, kind, r == bad_rank, h, prior, xs[r], idxs[r], ws[r], ex.shape[0])
        except epx.Error as e:
            err = e
        took = time.monotonic() - t0
        recv_x, out = _moe_layer(h, r, xs[r], idxs[r], ws[r], Experts(seed, E, H))
        return err, took, recv_x, out


def _check(results, op, kind, bad_rank, inputs, seed):
    """Every rank failed fast, each with its error; the layer afterwards matches the reference."""
    for r, (err, took, _, _) in enumerate(results):
        assert err is not None, f"rank {r} did not fail"
        assert took < TIMEOUT_MS / 1000 / 2, f"rank {r} took {took:.2f} s to fail ({err!r})"
        assert not isinstance(err, epx.CommTimeoutError), (r, err)
        if r == bad_rank:
            assert type(err) is (epx.ShapeError if kind == "shape" else epx.DTypeError), (r, err)
            assert err.message.startswith(OPS[op][0] + " "), err.message  # the Python check's message
        else:
            assert err.status == epx.Status.INVALID_ARGUMENT, (r, err)
            assert f"rank {bad_rank} failed {OPS[op][1]} (call" in err.message, (r, err.message)
    _check_layer([res[2:] for res in results], inputs, seed)


def _check_layer(layers, inputs, seed):
    """(recv_x, out) of each rank's correct layer against the reference."""
    xs, idxs, ws = inputs
    want = dense_moe(xs, idxs, ws, Experts(seed, E, H))
    for r, (recv_x, out) in enumerate(layers):
        ex, *_ = expected_expert_layout(xs, idxs, ws, R, L, r)
        np.testing.assert_array_equal(recv_x, ex)  # dispatch is a copy: exact
        np.testing.assert_allclose(out, want[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["shape", "dtype"])
@pytest.mark.parametrize("op", list(OPS))
def test_refusing_rank_takes_part(world4, op, kind):
    seed = 90 + list(OPS).index(op)
    inputs = make_inputs(seed, R, E, H, K, TOKENS)
    bad_rank = int(rng(seed).integers(R))

    def rank(r):
        return _rank(lambda rr: world4.comm(rr, **CFG), r, op, kind, bad_rank, inputs, seed)

    _check(world4.run(rank), op, kind, bad_rank, inputs, seed)


def test_refused_comm_config_fails_every_rank_at_once(world4):
    """A config Python refuses (an unknown field) still joins the config exchange."""
    bad_rank = int(rng(97).integers(R))

    def rank(r):
        t0 = time.monotonic()
        with pytest.raises(epx.InvalidArgumentError) as ei:
            epx.Comm(world4, r, **dict(CFG, **({"hiden": H} if r == bad_rank else {})))
        return ei.value, time.monotonic() - t0

    for r, (err, took) in enumerate(world4.run(rank)):
        assert took < TIMEOUT_MS / 1000 / 2, (r, took, err)
        if r == bad_rank:
            assert "unknown config fields ['hiden']" in err.message
        else:
            assert f"rank {bad_rank} passed an invalid config" in err.message, err.message
    inputs = make_inputs(97, R, E, H, K, TOKENS)

    def layer(r):  # the world works on
        with world4.comm(r, **CFG) as comm, comm.handle("ht", "expert") as h:
            return _moe_layer(h, r, *(a[r] for a in inputs), Experts(97, E, H))

    _check_layer(world4.run(layer), inputs, 97)


# ---- across processes --------------------------------------------------------------------------


def _process_worker(uid, r, bad_rank, seed, q):
    try:
        inputs = make_inputs(seed, R, E, H, K, TOKENS)
        with epx.World.from_unique_id(uid, r, R, backend="host") as w:
            err, took, recv_x, out = _rank(lambda rr: w.comm(**CFG), r, "dispatch", "shape", bad_rank, inputs, seed)
            e = None if err is None else (type(err).__name__, err.status, err.message)
            q.put((r, "ok", (e, took, recv_x, out)))
    except BaseException:  # report, never hang the parent
        q.put((r, "error", traceback.format_exc()))


def test_refusing_rank_takes_part_across_processes():
    if epx._lib.load().epx_world_create_rank is None:
        pytest.skip("this libepx lacks epx_world_create_rank")
    from spawn_ranks import spawn_ranks

    seed = 98
    bad_rank = int(rng(seed).integers(R))
    uid = epx.get_unique_id()
    got = spawn_ranks(_process_worker, [(uid, r, bad_rank, seed) for r in range(R)], timeout=120)
    results = []
    for r in range(R):
        e, took, recv_x, out = got[r]
        assert e is not None, f"rank {r} did not fail"
        name, status, message = e
        cls = getattr(epx, name)
        results.append((cls(status, message), took, recv_x, out))
    _check(results, "dispatch", "shape", bad_rank, make_inputs(seed, R, E, H, K, TOKENS), seed)


# ---- torch: epx.torch.dispatch checks its arguments, then calls Handle.dispatch ---------------


@pytest.mark.torch
@pytest.mark.parametrize("where", ["handle", "epx.torch", "dispatcher"])
def test_torch_refusal_takes_part_once(world4, where):
    """A refusal in Handle.dispatch under epx.torch.dispatch, in epx.torch.dispatch's own
    checks, or in FlexTokenDispatcher.token_dispatch's, takes part once: the correct layer
    after it pairs with the peers' (a second refused call would pair with their next dispatch
    instead)."""
    torch = pytest.importorskip("torch")
    import epx.torch as et

    seed = 99
    inputs = make_inputs(seed, R, E, H, K, TOKENS)
    experts = Experts(seed, E, H)
    bad_rank = int(rng(seed).integers(R))

    def rank(r):
        x, idx, w = (torch.from_numpy(a[r]) for a in inputs)
        with world4.comm(r, **CFG) as comm:
            d = et.FlexTokenDispatcher(comm)
            h = d.handle
            err, t0 = None, time.monotonic()
            try:
                if where == "dispatcher":
                    if r != bad_rank:  # the refusing rank skips the local first step
                        d.dispatch_preprocess(x, topk_idx=idx, topk_weights=w)
                    d.token_dispatch(x, w)
                elif r != bad_rank:
                    et.dispatch(h, x, idx, w)
                elif where == "handle":
                    et.dispatch(h, x[:, :-1].contiguous(), idx, w)
                else:
                    et.dispatch(h, x, idx, w, probs=w)  # probs go with a routing map
            except epx.Error as e:
                err = e
            took = time.monotonic() - t0
            res = et.dispatch(h, x, idx, w)
            y, start = np.zeros(tuple(res.recv_x.shape), np.float32), 0
            for l, c in enumerate(res.tokens_per_local_expert.tolist()):
                y[start:start + c] = experts(r * L + l, res.recv_x[start:start + c].detach().numpy())
                start += c
            out = et.combine(h, torch.from_numpy(y), res.recv_probs)  # weighted by the routing's weights
            d.close()
            return err, took, res.recv_x.detach().numpy(), out.detach().numpy()

    results = world4.run(rank)
    for r, (err, took, _, _) in enumerate(results):
        assert err is not None and took < TIMEOUT_MS / 1000 / 2, (r, err, took)
        if r == bad_rank:
            want = epx.ShapeError if where == "handle" else epx.InvalidArgumentError
            assert type(err) is want and not err.message.startswith("epx_"), (r, err)
        else:
            assert err.status == epx.Status.INVALID_ARGUMENT, (r, err)
            assert f"rank {bad_rank} failed epx_notify (call" in err.message, (r, err)  # the peers' first call
    _check_layer([res[2:] for res in results], inputs, seed)


def test_refused_handle_is_numbered_like_one_libepx_refuses(world4):
    """Handles are numbered per comm, failed creations too, and calls carry the number: a
    handle Python refuses (align 0) on one rank, while libepx refuses its peers' (a receive
    budget in the token layout), leaves the next handle the same number on every rank."""
    seed = 96
    inputs = make_inputs(seed, R, E, H, K, TOKENS)
    bad_rank = int(rng(seed).integers(R))

    def rank(r):
        with world4.comm(r, **CFG) as comm:
            with pytest.raises(epx.InvalidArgumentError) as ei:
                comm.handle("ht", "expert", align=0) if r == bad_rank else comm.handle("ht", "token", recv_budget=5)
            assert ("align" if r == bad_rank else "recv_budget") in ei.value.message, ei.value
            with comm.handle("ht", "expert") as h:
                return _moe_layer(h, r, *(a[r] for a in inputs), Experts(seed, E, H))

    _check_layer(world4.run(rank), inputs, seed)


# ---- CUDA (skipped without a GPU and the CUDA backend) ---------------------------------------


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and epx.backend_available("cuda")):
        pytest.skip("needs a CUDA GPU and a libepx built with the CUDA backend")
    return torch


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("algo,layout,exact", [("ht", "token", True), ("ht", "token", False), ("ll", "expert", True)])
@pytest.mark.parametrize("kind", ["shape", "dtype"])
def test_cuda_refusing_rank_takes_part(algo, layout, exact, kind):
    """Ranks sharing GPU 0, each on its own stream: one passes a wrong x, the others good
    ones. Every rank fails within half the timeout (sync-free peers when they synchronize),
    the refusing rank with its own error, its peers naming it; then a correct dispatch and
    combine on the same comm give the CPU backend's bits."""
    torch = _cuda_or_skip()
    HG, seed = 128, 95
    cfg = dict(CFG, hidden=HG)
    xs, idxs, ws = make_inputs(seed, R, E, HG, K, TOKENS)
    xb = [torch.tensor(x).to(torch.bfloat16) for x in xs]
    bad_rank = int(rng(seed).integers(R))

    def layer(h, r, device):
        res = h.dispatch(xb[r].to(device), torch.tensor(idxs[r]).to(device), torch.tensor(ws[r]).to(device))
        out = h.combine(res.recv_x)
        h.comm.synchronize()
        if device != "cpu":
            torch.cuda.current_stream().synchronize()
        return out.cpu()

    def rank(world, r):
        with world.comm(r, **cfg) as comm, comm.handle(algo, layout, exact=exact) as h:
            x = xb[r].cuda()
            if r == bad_rank:
                x = x[:, :-1].contiguous() if kind == "shape" else x.double()
            err, t0 = None, time.monotonic()
            try:
                h.dispatch(x, torch.tensor(idxs[r]).cuda(), torch.tensor(ws[r]).cuda())
                comm.synchronize()  # sync-free: a failure the device recorded is raised here
            except epx.Error as e:
                err = e
            return err, time.monotonic() - t0, layer(h, r, "cuda")

    with epx.World(R, backend="host") as world:
        want = world.run(lambda r: _host_layer(world, r, cfg, algo, layout, layer))
    with epx.World(R, backend="cuda", devices=[0] * R) as world:
        got = world.run(lambda r: rank(world, r))
    for r, (err, took, out) in enumerate(got):
        assert err is not None and took < TIMEOUT_MS / 1000 / 2, (r, err, took)
        if r == bad_rank:
            assert type(err) is (epx.ShapeError if kind == "shape" else epx.DTypeError), (r, err)
        else:
            # the host backend says "rank N failed <call>", the CUDA backend "rank N's <input> was refused"
            named = re.search(rf"rank {bad_rank}( failed|'s \w+ was refused)", err.message)
            assert err.status == epx.Status.INVALID_ARGUMENT and named, (r, err)
        assert torch.equal(out.view(torch.int16), want[r].view(torch.int16)), f"rank {r}"  # the CPU's bits


def _host_layer(world, r, cfg, algo, layout, layer):
    with world.comm(r, **cfg) as comm, comm.handle(algo, layout) as h:
        return layer(h, r, "cpu")
