"""Error paths raise the documented exceptions, with the status and the library's message."""

import numpy as np
import pytest

import epx
from moe_ref import make_inputs

R, E, H, K = 4, 8, 16, 2
CFG = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=4, timeout_ms=20000)


def every_rank_raises(excinfo, cls, nranks=R):
    """World.run re-raised the first error; every rank's error is in rank_errors."""
    errs = excinfo.value.rank_errors
    assert sorted(errs) == list(range(nranks)), errs
    for r, e in errs.items():
        assert isinstance(e, cls), (r, e)
    return errs


def test_error_hierarchy():
    e = epx.CommTimeoutError(epx.Status.TIMEOUT, "rank 1 waited for rank 2")
    assert isinstance(e, epx.Error) and isinstance(e, TimeoutError)
    assert epx.TimeoutError_ is epx.CommTimeoutError
    assert e.status == epx.Status.TIMEOUT and int(e.status) == 11 and e.status.name == "TIMEOUT"
    assert e.status_name == "EPX_ERR_TIMEOUT" and e.message == "rank 1 waited for rank 2"
    assert str(e) == "EPX_ERR_TIMEOUT: rank 1 waited for rank 2"
    for st in epx.Status:
        if st == epx.Status.SUCCESS:
            continue
        cls = epx.error_class(st)
        # every status has its own class, exported from epx, that raises it by default
        assert cls is not epx.Error and cls.default_status == st and getattr(epx, cls.__name__) is cls, st
        assert issubclass(cls, epx.Error) and cls(st, "x").status == st and cls().status == st
        assert epx.status_string(st).startswith(st.c_name)
    assert issubclass(epx.ExpertOutOfRangeError, ValueError)
    assert issubclass(epx.DTypeError, TypeError) and issubclass(epx.DTypeError, epx.InvalidArgumentError)
    assert issubclass(epx.UnsupportedError, NotImplementedError)
    assert issubclass(epx.OutOfMemoryError, MemoryError)
    assert epx.error_class(epx.Status.OUT_OF_STEP) is epx.OutOfStepError and issubclass(epx.OutOfStepError, RuntimeError)
    assert epx.error_class(epx.Status.BUSY) is epx.BusyError and issubclass(epx.BusyError, RuntimeError)


def test_bad_expert_id_fails_on_every_rank(world4):
    xs, idxs, ws = make_inputs(20, R, E, H, K, [3, 3, 3, 3])
    idxs[2][1, 0] = E  # out of range on rank 2 only

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht") as h:
            h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])

    with pytest.raises(epx.ExpertOutOfRangeError) as ei:
        world4.run(rank)
    errs = every_rank_raises(ei, epx.ExpertOutOfRangeError)
    assert "expert 8" in errs[2].message and errs[2].status == epx.Status.EXPERT_OUT_OF_RANGE
    assert "rank 2" in errs[0].message  # the others learn who failed


def test_negative_expert_id(world2):
    def rank(r):
        with world2.comm(r, num_experts=4, hidden=H, topk=1, timeout_ms=20000) as comm, comm.handle() as h:
            h.notify(topk_idx=np.array([[-2]], np.int64))

    with pytest.raises(epx.ExpertOutOfRangeError):
        world2.run(rank)


def test_repeated_expert_in_row(world2):
    def rank(r):
        with world2.comm(r, num_experts=4, hidden=H, topk=2, timeout_ms=20000) as comm, comm.handle() as h:
            h.notify(topk_idx=np.array([[1, 1]], np.int32))

    with pytest.raises(epx.InvalidArgumentError, match="twice"):
        world2.run(rank)


def test_config_mismatch(world4):
    def rank(r):
        epx.Comm(world4, r, **dict(CFG, hidden=H if r != 3 else 2 * H))

    with pytest.raises(epx.ConfigMismatchError) as ei:
        world4.run(rank)
    errs = every_rank_raises(ei, epx.ConfigMismatchError)
    assert "hidden" in errs[0].message


@pytest.mark.parametrize("field,value,cls", [
    ("num_experts", 6, epx.ExpertsNotDivisibleError),
    ("topk", 0, epx.TopkRangeError),
    ("topk", epx.MAX_TOPK + 1, epx.TopkRangeError),
    ("hidden", 0, epx.HiddenRangeError),
])
def test_bad_config(world4, field, value, cls):
    with pytest.raises(cls) as ei:
        world4.run(lambda r: epx.Comm(world4, r, **dict(CFG, **{field: value})))
    every_rank_raises(ei, cls)


def test_output_too_small(world4):
    xs, idxs, ws = make_inputs(21, R, E, H, K, [4, 4, 4, 4])

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ht", "token") as h:
            buf = np.zeros((1 if r == 0 else 64, H), np.float32)
            h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r], recv_x=buf)
            return True

    with pytest.raises(epx.OutputTooSmallError) as ei:
        world4.run(rank)
    assert ei.value.rank == 0 and list(ei.value.rank_errors) == [0]  # only the rank that was short
    assert "recv_capacity" in ei.value.message


def test_low_latency_overflow(world4):
    xs, idxs, ws = make_inputs(22, R, E, H, K, [2, 5, 2, 2])  # rank 1 has 5 > max_tokens_per_rank = 4

    def rank(r):
        with world4.comm(r, **CFG) as comm, comm.handle("ll") as h:
            h.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r])

    with pytest.raises(epx.LowLatencyOverflowError) as ei:
        world4.run(rank)
    errs = every_rank_raises(ei, epx.LowLatencyOverflowError)
    assert "max_tokens_per_rank" in errs[1].message


def test_routing_map_row_over_topk(world2):
    m = np.zeros((2, 4), bool)
    m[1, :3] = True  # three experts, topk 2

    def rank(r):
        with world2.comm(r, num_experts=4, hidden=H, topk=2, timeout_ms=20000) as comm, comm.handle() as h:
            h.notify(routing_map=m)

    with pytest.raises(epx.TopkRangeError):
        world2.run(rank)
    with pytest.raises(epx.TopkRangeError):
        epx.map_to_topk(m, None, topk=2)
    with pytest.raises(epx.InvalidArgumentError):
        epx.topk_to_map(np.array([[1, 1]]), None, num_experts=4)
    with pytest.raises(epx.ExpertOutOfRangeError):
        epx.topk_to_map(np.array([[1, 9]]), None, num_experts=4)


def test_timeout_then_broken(world2):
    """Rank 1 never enters the collective: rank 0 times out (naming the phase), and the comm is
    broken afterwards, failing fast."""

    def rank(r):
        with world2.comm(r, num_experts=4, hidden=H, topk=1, timeout_ms=300) as comm, comm.handle() as h:
            if r == 0:
                with pytest.raises(epx.CommTimeoutError) as ei:
                    h.notify(topk_idx=np.zeros((1, 1), np.int64))
                assert isinstance(ei.value, TimeoutError) and ei.value.status == epx.Status.TIMEOUT
                assert ei.value.message
                with pytest.raises(epx.BrokenCommError):
                    h.notify(topk_idx=np.zeros((1, 1), np.int64))
            return True

    assert world2.run(rank) == [True, True]


def test_python_side_checks(world2):
    cfg = dict(num_experts=4, hidden=H, topk=2, max_tokens_per_rank=4, timeout_ms=20000)
    x = np.zeros((3, H), np.float32)
    idx = np.array([[0, 1], [2, 3], [1, -1]], np.int64)

    def rank(r):
        out = []
        with world2.comm(r, **cfg) as comm, comm.handle("ht") as h:
            def expect(cls, fn):
                with pytest.raises(cls) as ei:
                    fn()
                out.append(ei.value)

            # every rank makes the same mistake, so none waits for the others
            expect(epx.ShapeError, lambda: h.dispatch(np.zeros((3, H + 1), np.float32), topk_idx=idx))
            expect(epx.ShapeError, lambda: h.dispatch(np.zeros((2, H), np.float32), topk_idx=idx))
            expect(epx.ShapeError, lambda: h.dispatch(x, topk_idx=idx[:, :1]))
            expect(epx.ShapeError, lambda: h.dispatch(x, topk_idx=idx, topk_weights=np.ones((3, 3))))
            expect(epx.DTypeError, lambda: h.dispatch(x.astype(np.float64), topk_idx=idx))
            expect(epx.DTypeError, lambda: h.dispatch(x, topk_idx=idx.astype(np.float32)))
            expect(epx.InvalidArgumentError, lambda: h.dispatch(x, topk_idx=idx, routing_map=np.zeros((3, 4), bool)))
            expect(epx.InvalidArgumentError, lambda: h.dispatch(x))  # no plan yet
            expect(epx.InvalidArgumentError, lambda: h.combine(x))  # no plan yet
            expect(epx.InvalidArgumentError, lambda: h.dispatch(x, topk_idx=idx, scale_by_probs=True))
            expect(epx.DTypeError, lambda: h.dispatch(x, topk_idx=idx, recv_dtype="float64"))
            res = h.dispatch(x, topk_idx=idx)
            expect(epx.ShapeError, lambda: h.combine(np.zeros((res.recv_x.shape[0], H - 1), np.float32)))
            if res.recv_x.shape[0] > 0:
                expect(epx.ShapeError, lambda: h.combine(np.zeros((res.recv_x.shape[0] - 1, H), np.float32)))
            expect(epx.DTypeError, lambda: h.combine(res.recv_x.astype(np.float64)))
            expect(epx.ShapeError, lambda: h.combine(res.recv_x, out=np.zeros((2, H), np.float32)))
            expect(epx.InvalidArgumentError, lambda: h.combine(res.recv_x, row_probs=np.zeros(1, np.float32)))
            ok = h.combine(res.recv_x)  # and the comm still works
            assert ok.shape == (3, H)
        return out

    for errs in world2.run(rank):
        for e in errs:
            assert e.status == epx.Status.INVALID_ARGUMENT and e.message


def test_row_alignment_bf16(world2):
    """bf16 rows must be whole 16-byte vectors (hidden 4 -> 8 bytes); float32 is exempt on the host."""

    def rank(r):
        with world2.comm(r, num_experts=2, hidden=4, topk=1, timeout_ms=20000) as comm, comm.handle() as h:
            idx = np.zeros((1, 1), np.int64)
            h.dispatch(np.zeros((1, 4), np.float32), topk_idx=idx)  # fine
            h.dispatch(np.zeros((1, 4), np.uint16), topk_idx=idx)

    with pytest.raises(epx.RowAlignmentError):
        world2.run(rank)


def test_unknown_names():
    with pytest.raises(epx.InvalidArgumentError):
        epx.World(2, backend="tpu")
    with pytest.raises(epx.InvalidArgumentError):
        epx.World(0, backend="host")
    with epx.World(1, backend="host") as w, w.comm(0, **CFG) as c:
        with pytest.raises(epx.InvalidArgumentError):
            c.handle("fast")
        with pytest.raises(epx.InvalidArgumentError):
            c.handle("ht", "column")
        with pytest.raises(epx.InvalidArgumentError):
            c.handle("ht", align=0)
        with pytest.raises(epx.InvalidArgumentError):
            epx.Comm(w, 0, bogus=1)


def test_cuda_unavailable_is_unsupported():
    if epx.backend_available("cuda"):
        pytest.skip("this machine has the CUDA backend")
    with pytest.raises(epx.UnsupportedError) as ei:
        epx.World(2, backend="cuda")
    assert ei.value.message
    assert epx.backend_unavailable_reason("cuda")
    assert epx.World(1, backend="auto").backend == "host"


def test_world_run_reraises_first_and_collects():
    with epx.World(3, backend="host") as w:
        def fn(r):
            if r == 1:
                raise KeyError("one")
            return r * 10

        with pytest.raises(KeyError) as ei:
            w.run(fn)
        assert ei.value.rank == 1 and list(ei.value.rank_errors) == [1]
        assert w.run(lambda r, a, b=0: (r, a, b), "a", b=2) == [(0, "a", 2), (1, "a", 2), (2, "a", 2)]
        with pytest.raises(ValueError, match="streams are for a CUDA world"):
            w.run(lambda r: r, streams=[None] * 3)


def test_teardown_order_and_closed_objects():
    w = epx.World(2, backend="host")
    comms = w.init_comms(**dict(CFG, num_experts=4))
    hs = [c.handle("ht") for c in comms]
    w.close()  # closes the handles and comms still open on it, then the world
    assert w.closed and all(c._ptr is None for c in comms) and all(h._ptr is None for h in hs)
    with pytest.raises(epx.InvalidArgumentError, match="closed"):
        hs[0].notify(topk_idx=np.zeros((1, 2), np.int64))
    with pytest.raises(epx.InvalidArgumentError, match="closed"):
        comms[0].handle()
    with pytest.raises(epx.InvalidArgumentError, match="closed"):
        epx.Comm(w, 0, **CFG)
    w.close()  # idempotent


def test_garbage_collection_without_close():
    import gc

    for _ in range(3):
        w = epx.World(2, backend="host")
        comms = w.init_comms(**dict(CFG, num_experts=4))
        hs = [c.handle("ll") for c in comms]
        del w, comms, hs
        gc.collect()
