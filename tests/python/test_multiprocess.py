"""Groups spread over processes: World.from_unique_id (NCCL-style id) and World.from_allgather
(the caller's allgather, the path torch.distributed takes), two ranks in two processes on the
CPU backend, checked against the numpy reference."""

import multiprocessing as mp

import numpy as np
import pytest

import epx
from moe_ref import Experts, dense_moe, expected_expert_layout, make_inputs

R, E, H, K = 2, 4, 16, 2
TOKENS = [5, 3]


def _needs(*names):
    lib = epx._lib.load()
    missing = [n for n in names if getattr(lib, n) is None]
    if missing:
        pytest.skip(f"this libepx lacks {missing}")


def _layer(world, r):
    xs, idxs, ws = make_inputs(70, R, E, H, K, TOKENS)
    f = Experts(70, E, H)
    with world.comm(num_experts=E, hidden=H, topk=K, timeout_ms=20000) as comm, comm.handle("ht", "expert") as h:
        assert comm.rank == r and comm.nranks == R
        res = h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])
        y, start = np.zeros_like(res.recv_x), 0
        for l, c in enumerate(res.tokens_per_local_expert):
            y[start:start + c] = f(r * (E // R) + l, res.recv_x[start:start + c])
            start += c
        return res.recv_x, h.combine(y)


def _worker_uid(uid, r, q):
    try:
        with epx.World.from_unique_id(uid, r, R, backend="host") as w:
            assert w.ranks == [r] and not w.is_local
            q.put((r, _layer(w, r)))
    except BaseException as e:  # report, never hang the parent
        q.put((r, repr(e)))


def _worker_allgather(conn, r, q):
    def allgather(mine):
        conn.send_bytes(mine)
        other = conn.recv_bytes()
        return [mine, other] if r == 0 else [other, mine]

    try:
        with epx.World.from_allgather(allgather, r, R, backend="host") as w:
            q.put((r, _layer(w, r)))
    except BaseException as e:
        q.put((r, repr(e)))


def _run(target, args_per_rank):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=args + (r, q)) for r, args in enumerate(args_per_rank)]
    for p in ps:
        p.start()
    try:
        got = dict(q.get(timeout=120) for _ in ps)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in range(R):
        assert not isinstance(got[r], str), f"rank {r}: {got[r]}"
    xs, idxs, ws = make_inputs(70, R, E, H, K, TOKENS)
    want = dense_moe(xs, idxs, ws, Experts(70, E, H))
    for r in range(R):
        recv_x, out = got[r]
        ex, *_ = expected_expert_layout(xs, idxs, ws, R, E // R, r)
        np.testing.assert_array_equal(recv_x, ex)
        np.testing.assert_allclose(out, want[r], rtol=1e-5, atol=1e-5)


def test_unique_id_two_processes():
    _needs("epx_get_unique_id", "epx_world_create_rank")
    uid = epx.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == epx.UNIQUE_ID_BYTES
    _run(_worker_uid, [(uid,), (uid,)])


def test_allgather_two_processes():
    _needs("epx_world_create_rank_with")
    a, b = mp.get_context("spawn").Pipe()
    _run(_worker_allgather, [(a,), (b,)])


def test_allgather_one_rank_and_a_failing_callback():
    _needs("epx_world_create_rank_with")
    with epx.World.from_allgather(lambda mine: [mine], 0, 1, backend="host") as w:
        assert w.nranks == 1 and w.rank == 0
        with w.comm(num_experts=2, hidden=8, topk=1) as c, c.handle() as h:
            res = h.dispatch(np.ones((2, 8), np.float32), topk_idx=np.array([[0], [1]]))
            assert res.recv_x.shape == (2, 8)

    def broken(mine):
        raise ConnectionError("the network is down")

    with pytest.raises(epx.Error) as ei:
        epx.World.from_allgather(broken, 0, 1, backend="host")
    assert "network is down" in str(ei.value)
    with pytest.raises(epx.InvalidArgumentError):
        epx.World.from_unique_id(b"short", 0, 2)
