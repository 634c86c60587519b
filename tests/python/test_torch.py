"""PyTorch integration: tensors through the handle, autograd through DispatchFunction and
CombineFunction against a dense float64 torch reference, the Megatron-style dispatcher, and
(marked gpu) the CUDA backend with CUDA tensors and graphs. Skipped without torch."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from moe_ref import BASE_SEED, make_inputs, rng, to_map  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def _torch_seed():
    torch.manual_seed(BASE_SEED)  # torch's own draws (rand, randn) are fresh per run too

R, E, H, K = 4, 8, 16, 3
L = E // R
TOKENS = [5, 0, 7, 3]
M = 8
CFG = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=M, timeout_ms=20000)


class Params:
    """Per global expert e: f_e(x) = x * scale[e] + shift[e]; G[r] weights the loss."""

    def __init__(self, seed):
        g = rng(seed + 2000)
        self.xs, self.idxs, self.ws = make_inputs(seed, R, E, H, K, TOKENS)
        self.scale = g.uniform(0.5, 1.5, (E, H)).astype(np.float32)
        self.shift = g.uniform(-0.5, 0.5, (E, H)).astype(np.float32)
        self.G = [g.uniform(-1, 1, (T, H)).astype(np.float32) for T in TOKENS]

    def dense(self, idxs=None, ws=None):
        """Dense float64 reference: outputs and the gradients of sum_r <out_r, G_r>."""
        idxs = self.idxs if idxs is None else idxs
        ws = self.ws if ws is None else ws
        scale = torch.tensor(self.scale, dtype=torch.float64, requires_grad=True)
        shift = torch.tensor(self.shift, dtype=torch.float64, requires_grad=True)
        xs = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in self.xs]
        wts = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in ws]
        outs, loss = [], 0
        for r in range(R):
            idx = torch.tensor(idxs[r])
            valid = (idx >= 0).to(torch.float64)
            e = idx.clamp(min=0)
            f = xs[r][:, None, :] * scale[e] + shift[e]  # [T, K, H]
            out = (wts[r][..., None] * valid[..., None] * f).sum(1)
            outs.append(out)
            loss = loss + (out * torch.tensor(self.G[r], dtype=torch.float64)).sum()
        loss.backward()
        return dict(out=[o.detach() for o in outs], x=[x.grad for x in xs], w=[w.grad for w in wts],
                    scale=scale.grad, shift=shift.grad)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), rtol=tol, atol=tol)


def run_ranks(fn):
    with epx.World(R, backend="host") as world:
        return world.run(lambda r: fn(world, r))


def leaves(P, r):
    x = torch.tensor(P.xs[r], requires_grad=True)
    w = torch.tensor(P.ws[r], requires_grad=True)
    scale = torch.tensor(P.scale[r * L:(r + 1) * L], requires_grad=True)
    shift = torch.tensor(P.shift[r * L:(r + 1) * L], requires_grad=True)
    return x, w, scale, shift


def expert_rows(recv_x, counts, scale, shift, align=1, probs=None):
    """Expert layout rows -> f_l(rows) per block (padding rows 0); times probs if given."""
    out, start = [], 0
    for l in range(L):
        c = int(counts[l])
        size = (c + align - 1) // align * align
        blk = recv_x[start:start + c] * scale[l] + shift[l]
        out.append(torch.cat([blk, torch.zeros(size - c, H, device=recv_x.device)], 0))
        start += size
    y = torch.cat(out, 0) if out else recv_x[:0]
    if probs is not None:
        y = y * probs[:, None]
    return y


def check_grads(P, got, want):
    for r in range(R):
        out, gx, gw, gscale, gshift = got[r]
        close(out, want["out"][r])
        close(gx, want["x"][r])
        close(gw, want["w"][r])
        close(gscale, want["scale"][r * L:(r + 1) * L])
        close(gshift, want["shift"][r * L:(r + 1) * L])


# ---- autograd through the functions ------------------------------------------------------------------


def test_autograd_token_layout():
    P = Params(30)

    def rank(world, r):
        x, w, scale, shift = leaves(P, r)
        with world.comm(r, **CFG) as comm, comm.handle("ht", "token") as h:
            res = et.dispatch(h, x, torch.tensor(P.idxs[r]), w)
            ridx = res.recv_topk_idx.long()
            valid = (ridx >= 0).float()
            li = ridx.clamp(min=0)
            f = res.recv_x[:, None, :] * scale[li] + shift[li]
            y = (res.recv_topk_weights[..., None] * valid[..., None] * f).sum(1)
            out = et.combine(h, y)
            (out * torch.tensor(P.G[r])).sum().backward()
            return out.detach(), x.grad, w.grad, scale.grad, shift.grad

    check_grads(P, run_ranks(rank), P.dense())


@pytest.mark.parametrize("where", ["combine", "expert"])
@pytest.mark.parametrize("align", [1, 4])
def test_autograd_expert_layout(where, align):
    """Probabilities applied in combine (weighted, row_probs differentiable) or in the expert
    (Megatron: rows times probs, unweighted combine)."""
    P = Params(31)

    def rank(world, r):
        x, w, scale, shift = leaves(P, r)
        with world.comm(r, **CFG) as comm, comm.handle("ht", "expert", align=align) as h:
            res = et.dispatch(h, x, torch.tensor(P.idxs[r]).to(torch.int32), w)
            if where == "combine":
                y = expert_rows(res.recv_x, res.tokens_per_local_expert, scale, shift, align)
                out = et.combine(h, y, res.recv_probs)
            else:
                y = expert_rows(res.recv_x, res.tokens_per_local_expert, scale, shift, align, res.recv_probs)
                out = et.combine(h, y, weighted=False)
            (out * torch.tensor(P.G[r])).sum().backward()
            return out.detach(), x.grad, w.grad, scale.grad, shift.grad

    check_grads(P, run_ranks(rank), P.dense())


def test_autograd_low_latency():
    P = Params(32)

    def rank(world, r):
        x, w, scale, shift = leaves(P, r)
        with world.comm(r, **CFG) as comm, comm.handle("ll") as h:
            res = et.dispatch(h, x, torch.tensor(P.idxs[r]), w)
            assert tuple(res.recv_x.shape) == (L, R * M, H)
            y = res.recv_x * scale[:, None, :] + shift[:, None, :]  # every row, also past the counts
            out = et.combine(h, y, res.recv_probs)
            (out * torch.tensor(P.G[r])).sum().backward()
            return out.detach(), x.grad, w.grad, scale.grad, shift.grad

    check_grads(P, run_ranks(rank), P.dense())  # rows past the counts get no gradient


def test_autograd_delivered_weights_without_row_probs():
    """combine(weighted) with the weights dispatch delivered (row_probs None): the gradient of y
    comes from the dispatch replay with scale_by_probs."""
    P = Params(33)

    def rank(world, r):
        x, w, scale, shift = leaves(P, r)
        with world.comm(r, **CFG) as comm, comm.handle("ht", "expert") as h:
            res = et.dispatch(h, x, torch.tensor(P.idxs[r]), w.detach())
            y = expert_rows(res.recv_x, res.tokens_per_local_expert, scale, shift)
            out = et.CombineFunction.apply(h, y, None, True, None)
            (out * torch.tensor(P.G[r])).sum().backward()
            return out.detach(), x.grad, scale.grad, shift.grad

    want = P.dense()
    for r, (out, gx, gscale, gshift) in enumerate(run_ranks(rank)):
        close(out, want["out"][r])
        close(gx, want["x"][r])
        close(gscale, want["scale"][r * L:(r + 1) * L])
        close(gshift, want["shift"][r * L:(r + 1) * L])


def test_replanned_handle_refuses_backward():
    P = Params(34)

    def rank(world, r):
        x, w, _, _ = leaves(P, r)
        with world.comm(r, **CFG) as comm, comm.handle("ht", "token") as h:
            res = et.dispatch(h, x, torch.tensor(P.idxs[r]), w)
            out = et.combine(h, res.recv_x * 2)
            h.notify(topk_idx=P.idxs[r])  # a new plan before the backward
            with pytest.raises(RuntimeError, match="re-planned"):
                out.sum().backward()
            return True

    assert run_ranks(rank) == [True] * R


# ---- the flex dispatcher ------------------------------------------------------------------------------


@pytest.mark.parametrize("apply_in_combine", [False, True])
def test_flex_dispatcher_train_then_decode(apply_in_combine):
    flex_train_then_decode(apply_in_combine, "cpu")


def flex_train_then_decode(apply_in_combine, device):
    """One model trains a step (high-throughput, with backward) then decodes (low-latency)
    through the same dispatcher; both against the dense float64 layer."""
    P = Params(35)
    g = rng(3035)
    logits = [g.standard_normal((T, E)).astype(np.float32) for T in TOKENS]

    def route(lg):
        """Megatron-style router: softmax, top-k mask -> routing_map [T, E] and probs [T, E]."""
        sm = torch.softmax(lg, dim=-1)
        top = sm.topk(K, dim=-1).indices
        m = torch.zeros_like(sm, dtype=torch.bool).scatter(1, top, True)
        return m, sm * m

    def layer(d, x, m, probs, scale, shift):
        xs_, p = d.dispatch_preprocess(x.reshape(1, -1, H), m, probs)
        rx, rp = d.token_dispatch(xs_, p)
        rx, tpe, rp = d.dispatch_postprocess(rx, rp)
        if d.algo == "ll":
            y = rx * scale[:, None, :] + shift[:, None, :]
            if not apply_in_combine:
                y = y * rp[..., None]
        else:
            assert tpe.dtype == torch.int64 and tpe.device.type == "cpu" and int(tpe.sum()) == rx.shape[0]
            y = expert_rows(rx, d.num_tokens_per_expert, scale, shift, d.align, None if apply_in_combine else rp)
        y = d.combine_preprocess(y)
        y = d.token_combine(y)
        return d.combine_postprocess(y)

    def rank(world, r):
        x, _, scale, shift = (t.detach().to(device).requires_grad_() for t in leaves(P, r))
        lg = torch.tensor(logits[r], device=device, requires_grad=True)
        with world.comm(r, **CFG) as comm:
            d = et.FlexTokenDispatcher(comm, align=4, apply_probs_in_combine=apply_in_combine)
            m, probs = route(lg)
            out = layer(d, x, m, probs, scale, shift)
            assert out.shape == (1, TOKENS[r], H)
            (out[0] * torch.tensor(P.G[r], device=device)).sum().backward()
            train = (out.detach()[0], x.grad, lg.grad, scale.grad, shift.grad)
            d.set_mode("decode")  # prefill -> decode is one call
            assert d.algo == "ll"
            with torch.no_grad():
                dec = layer(d, x, m, probs, scale, shift)[0]
            comm.synchronize()
            d.close()
            return tuple(t.cpu() for t in train), dec.cpu()

    if device == "cpu":
        got = run_ranks(rank)
    else:
        with epx.World(R, backend="cuda", devices=[0] * R) as world:
            got = world.run(lambda r: rank(world, r))
    # dense reference with the same router, float64
    lgs = [torch.tensor(lg, dtype=torch.float64, requires_grad=True) for lg in logits]
    idxs, wts = [], []
    for lg in lgs:
        sm = torch.softmax(lg, -1)
        top = sm.topk(K, dim=-1).indices.sort(dim=-1).values
        idxs.append(top.numpy())
        wts.append(sm.gather(1, top))
    scale = torch.tensor(P.scale, dtype=torch.float64, requires_grad=True)
    shift = torch.tensor(P.shift, dtype=torch.float64, requires_grad=True)
    xs = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in P.xs]
    loss = 0
    outs = []
    for r in range(R):
        e = torch.tensor(idxs[r])
        f = xs[r][:, None, :] * scale[e] + shift[e]
        out = (wts[r][..., None] * f).sum(1)
        outs.append(out.detach())
        loss = loss + (out * torch.tensor(P.G[r], dtype=torch.float64)).sum()
    loss.backward()
    for r in range(R):
        (out, gx, glg, gscale, gshift), dec = got[r]
        close(out, outs[r])
        close(dec, outs[r])
        close(gx, xs[r].grad)
        close(glg, lgs[r].grad)
        close(gscale, scale.grad[r * L:(r + 1) * L])
        close(gshift, shift.grad[r * L:(r + 1) * L])


def test_flex_dispatcher_topk_form_and_alltoall():
    P = Params(36)

    def rank(world, r):
        x, w, scale, shift = leaves(P, r)
        with world.comm(r, **CFG) as comm:
            d = et.FlexTokenDispatcher(comm, algos={"train": "alltoall"})
            rx, tpe, rp = d.dispatch(x, topk_idx=torch.tensor(P.idxs[r]), topk_weights=w)
            y = expert_rows(rx, tpe, scale, shift, 1, rp)
            out = d.combine(y)
            (out * torch.tensor(P.G[r])).sum().backward()
            d.close()
            return out.detach(), x.grad, w.grad, scale.grad, shift.grad

    check_grads(P, run_ranks(rank), P.dense())


# ---- tensors without autograd, conversions --------------------------------------------------------------


def test_handle_takes_cpu_tensors_bf16():
    xs, idxs, ws = make_inputs(37, R, E, H, K, TOKENS)

    def rank(world, r):
        with world.comm(r, **CFG) as comm, comm.handle("ht", "expert", align=2) as h:
            xb = torch.tensor(xs[r]).to(torch.bfloat16)
            res_t = h.dispatch(xb, torch.tensor(idxs[r]), torch.tensor(ws[r]))
            out_t = h.combine(res_t.recv_x)
            bits = xb.view(torch.int16).numpy().view(np.uint16)
            res_n = h.dispatch(bits, idxs[r], ws[r])
            out_n = h.combine(res_n.recv_x)
            return res_t, out_t, res_n, out_n

    for res_t, out_t, res_n, out_n in run_ranks(rank):
        assert res_t.recv_x.dtype == torch.bfloat16 and out_t.dtype == torch.bfloat16
        np.testing.assert_array_equal(res_t.recv_x.view(torch.int16).numpy().view(np.uint16), res_n.recv_x)
        np.testing.assert_array_equal(out_t.view(torch.int16).numpy().view(np.uint16), out_n)
        np.testing.assert_array_equal(res_t.recv_probs.numpy(), res_n.recv_probs)


def test_mixing_numpy_and_torch_is_refused():
    with epx.World(1, backend="host") as w, w.comm(0, **dict(CFG, num_experts=4)) as c, c.handle() as h:
        with pytest.raises(epx.DTypeError, match="do not mix"):
            h.dispatch(torch.zeros(2, H), topk_idx=np.zeros((2, K), np.int64))


def test_torch_routing_conversions():
    _, idxs, ws = make_inputs(38, 1, 16, 4, 4, [30])
    m, p = to_map(idxs[0], ws[0], 16)
    ti, tw = et.map_to_topk(torch.tensor(m), torch.tensor(p), 4)
    ni, nw = epx.map_to_topk(m, p, topk=4)
    np.testing.assert_array_equal(ti.numpy(), ni)
    np.testing.assert_array_equal(tw.numpy(), nw)
    tm, tp = et.topk_to_map(torch.tensor(idxs[0]), torch.tensor(ws[0]), 16)
    np.testing.assert_array_equal(tm.numpy(), m)
    np.testing.assert_array_equal(tp.numpy(), p)
    m2 = m.copy()
    m2[0] = True
    with pytest.raises(epx.TopkRangeError):
        et.map_to_topk(torch.tensor(m2), None, 4)


def test_from_torch_distributed_single_process(tmp_path):
    """A one-rank gloo group bootstraps a one-rank world through the allgather callback."""
    import torch.distributed as dist

    lib = epx._lib.load()
    if lib.epx_world_create_rank_with is None:
        pytest.skip("this libepx has no epx_world_create_rank_with")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with epx.World.from_torch_distributed(backend="host") as w:
            assert w.nranks == 1 and w.rank == 0 and w.backend == "host"
            with w.comm(num_experts=2, hidden=H, topk=1, timeout_ms=20000) as c, c.handle() as h:
                x = torch.randn(3, H)
                res = h.dispatch(x, torch.tensor([[0], [1], [-1]]))
                assert torch.equal(res.recv_x, x[:2])
    finally:
        dist.destroy_process_group()


# ---- CUDA (skipped without a GPU and the CUDA backend) ----------------------------------------------------

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and epx.backend_available("cuda")),
                         reason="needs a CUDA GPU and a libepx built with the CUDA backend")


def _host_reference(xs_bf16, idxs, ws, algo, layout, align=1):
    """The same layer on the CPU backend: (recv_x, out) per rank, bf16 bits."""

    def rank(world, r):
        with world.comm(r, **CFG_GPU) as comm, comm.handle(algo, layout, align=align) as h:
            res = h.dispatch(xs_bf16[r], torch.tensor(idxs[r]), torch.tensor(ws[r]))
            y = res.recv_x
            return res.recv_x.clone(), h.combine(y)

    with epx.World(len(xs_bf16), backend="host") as world:
        return world.run(lambda r: rank(world, r))


HG = 128
CFG_GPU = dict(num_experts=E, hidden=HG, topk=K, max_tokens_per_rank=M, timeout_ms=10000)


def _cuda_layer(world, r, xb, idxs, ws, algo, layout):
    """dispatch -> combine of rank r on CUDA tensors, on the caller's current stream."""
    with world.comm(r, **CFG_GPU) as comm, comm.handle(algo, layout) as h:
        res = h.dispatch(xb[r].cuda(), torch.tensor(idxs[r]).cuda(), torch.tensor(ws[r]).cuda())
        out = h.combine(res.recv_x)
        comm.synchronize()
        torch.cuda.current_stream().synchronize()
        return res.recv_x.cpu(), out.cpu(), res.tokens_per_local_expert.cpu()


def _assert_same_bits(got, want, algo):
    for r, ((rx, out, counts), (wrx, wout)) in enumerate(zip(got, want)):
        if algo == "ll":
            for l in range(L):
                c = int(counts[l])
                assert torch.equal(rx[l, :c].view(torch.int16), wrx[l, :c].view(torch.int16)), f"rank {r} expert {l}"
        else:
            assert torch.equal(rx.view(torch.int16), wrx.view(torch.int16)), f"rank {r}"
        assert torch.equal(out.view(torch.int16), wout.view(torch.int16)), f"rank {r}"  # same bits on every backend


LAYERS = [("ht", "token"), ("ht", "expert"), ("ll", "expert")]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("algo,layout", LAYERS)
def test_cuda_tensors_match_host(algo, layout):
    """CUDA tensors on 4 ranks sharing GPU 0 give the CPU backend's bits, epx following the
    streams the caller made (passed to World.run, which makes each current in its rank)."""
    xs, idxs, ws = make_inputs(40, R, E, HG, K, TOKENS)
    xb = [torch.tensor(x).to(torch.bfloat16) for x in xs]
    want = _host_reference(xb, idxs, ws, algo, layout)
    streams = [torch.cuda.Stream(torch.device("cuda", 0)) for _ in range(R)]
    with epx.World(R, backend="cuda", devices=[0] * R) as world:
        got = world.run(lambda r: _cuda_layer(world, r, xb, idxs, ws, algo, layout), streams=streams)
    _assert_same_bits(got, want, algo)


@gpu
@pytest.mark.gpu
def test_cuda_legacy_stream_refused_when_ranks_share_a_gpu():
    """torch's legacy default stream is one queue for the whole GPU: ranks sharing a GPU on it
    would queue behind each other's waiting kernels, so the frontend refuses before any
    collective starts, on every rank, instead of stalling until the timeout."""
    xs, idxs, ws = make_inputs(41, 2, E, HG, K, TOKENS[:2])
    xb = [torch.tensor(x).to(torch.bfloat16) for x in xs]
    legacy = torch.cuda.default_stream(torch.device("cuda", 0))
    t0 = time.monotonic()
    with epx.World(2, backend="cuda", devices=[0, 0]) as world:
        with pytest.raises(epx.DeviceError, match="default stream") as ei:
            world.run(lambda r: _cuda_layer(world, r, xb, idxs, ws, "ht", "token"), streams=[legacy, legacy])
    assert sorted(ei.value.rank_errors) == [0, 1]
    assert time.monotonic() - t0 < CFG_GPU["timeout_ms"] / 1000.0


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a GPU per rank")
@pytest.mark.parametrize("algo,layout", LAYERS)
def test_cuda_legacy_stream_one_rank_per_gpu(algo, layout):
    """On torch's legacy default stream (torch's default) with a GPU per rank: epx runs on a
    side stream of the comm, fenced both ways with the caller's stream; same bits as the CPU."""
    xs, idxs, ws = make_inputs(42, 2, E, HG, K, TOKENS[:2])
    xb = [torch.tensor(x).to(torch.bfloat16) for x in xs]
    want = _host_reference(xb, idxs, ws, algo, layout)
    streams = [torch.cuda.default_stream(torch.device("cuda", d)) for d in range(2)]
    with epx.World(2, backend="cuda", devices=[0, 1]) as world:
        got = world.run(lambda r: _cuda_layer(world, r, xb, idxs, ws, algo, layout), streams=streams)
    _assert_same_bits(got, want, algo)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("round_", range(int(os.environ.get("EPX_TEST_REPEAT", "2"))))
def test_cuda_autograd_matches_cpu(round_):
    """The whole layer's forward and backward on CUDA against the CPU backend. The backward
    passes of all ranks run on torch's one autograd thread for the GPU, so this also checks
    that epx's collectives never wait on the host for a peer. Repeated (EPX_TEST_REPEAT) with
    fresh inputs each round."""
    P = Params(41 + 100 * round_)

    def make(device):
        def rank(world, r):
            x, w, scale, shift = (t.detach().to(device).requires_grad_() for t in leaves(P, r))
            with world.comm(r, **CFG) as comm, comm.handle("ht", "expert") as h:
                res = et.dispatch(h, x, torch.tensor(P.idxs[r], device=device), w)
                counts = res.tokens_per_local_expert.cpu()
                out_rows, start = [], 0
                for l in range(L):
                    c = int(counts[l])
                    out_rows.append(res.recv_x[start:start + c] * scale[l] + shift[l])
                    start += c
                y = torch.cat(out_rows, 0)
                out = et.combine(h, y, res.recv_probs)
                (out * torch.tensor(P.G[r], device=device)).sum().backward()
                # this rank's stream only: a device-wide sync here, while torch's autograd thread may
                # still be launching other ranks' backward collectives, stalled the group until the
                # timeout (the README's rule for ranks sharing a GPU)
                torch.cuda.current_stream().synchronize()
                comm.synchronize()  # a collective that failed on the device raises here, not as wrong numbers
                return [t.detach().cpu() for t in (out, x.grad, w.grad, scale.grad, shift.grad)]
        return rank

    with epx.World(R, backend="host") as world:
        cpu = world.run(lambda r: make("cpu")(world, r))
    with epx.World(R, backend="cuda", devices=[0] * R) as world:
        gpu_ = world.run(lambda r: make("cuda")(world, r))
    names = ("out", "x.grad", "w.grad", "scale.grad", "shift.grad")
    bad = []
    for r, (a, b) in enumerate(zip(cpu, gpu_)):
        for name, ta, tb in zip(names, a, b):
            # the layer's output and x.grad are epx's reductions alone: same bits on both
            # backends; the others also go through torch's own reductions
            same = torch.equal(ta, tb) if name in ("out", "x.grad") else torch.allclose(ta, tb, rtol=1e-5, atol=1e-6)
            if not same:
                diff = (ta.double() - tb.double()).abs()
                where = (diff > 0).nonzero()
                bad.append(f"rank {r} {name}: {where.shape[0]} of {diff.numel()} differ, max {float(diff.max()):.3g}, "
                           f"first at {where[0].tolist()}: cpu {float(ta[tuple(where[0])])} cuda {float(tb[tuple(where[0])])}")
    assert not bad, "\n".join(bad)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("apply_in_combine", [False, True])
def test_cuda_flex_dispatcher_train_then_decode(apply_in_combine):
    """Prefill/training and decode in one model on CUDA tensors, against the dense float64 layer."""
    flex_train_then_decode(apply_in_combine, "cuda")


# Ranks' host reads (.item() and the like) while a peer waits for them in a low-latency dispatch,
# in a process of its own (argv: R E H K M): the reads' values and the dispatch's counts, "ok".
HOST_READS_SCRIPT = """
import sys, threading, time
import numpy as np, torch, epx
from moe_ref import make_inputs
R, E, H, K, M = map(int, sys.argv[1:6])
L = E // R
xs, idxs, ws = make_inputs(60, R, E, H, K, [M] * R)
made = threading.Barrier(R)

def rank(world, r):
    dev = torch.device("cuda", 0)
    cfg = dict(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=M, timeout_ms=10000)
    with world.comm(r, **cfg) as comm, comm.handle("ll") as h:
        x = torch.tensor(xs[r], device=dev).to(torch.bfloat16)
        i, w = torch.tensor(idxs[r], device=dev), torch.tensor(ws[r], device=dev)
        torch.cuda.current_stream(dev).synchronize()
        made.wait()
        reads = None
        if r > 0:
            time.sleep(0.2)  # rank 0's dispatch is waiting for this rank by now
            reads = (int(i.sum()), bool((i >= 0).all()), int((w > 0).sum()))
        counts = h.dispatch(x, i, w).tokens_per_local_expert.cpu()
        comm.synchronize()
        return reads, counts

with epx.World(R, backend="cuda", devices=[0] * R) as world:
    got = world.run(lambda r: rank(world, r))
for r, (reads, counts) in enumerate(got):
    if r > 0:
        assert reads == (int(idxs[r].sum()), bool((idxs[r] >= 0).all()), int((ws[r] > 0).sum())), r
    want = [sum(int((idxs[q] == r * L + l).sum()) for q in range(R)) for l in range(L)]
    assert counts.tolist() == want, (r, counts.tolist(), want)
print("ok")
"""


@gpu
@pytest.mark.gpu
def test_cuda_host_reads_while_a_peer_waits():
    """Ranks' reads of CUDA values to the host, made while a peer waits for them inside a
    low-latency dispatch, do not stall the group. A host read goes through a page-locked block
    of torch's host cache, and a process's first page-locked allocation waited for a kernel
    running on another stream (bench/RESULTS.md, 2026-12-06): World.run makes it before the
    ranks start. In a fresh process, so that its first allocation is the one in question."""
    paths = [str(Path(__file__).resolve().parent)] + ([] if os.environ.get("EPX_TEST_INSTALLED") == "1" else
                                                       [str(Path(__file__).resolve().parents[2] / "python")])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths + [os.environ.get("PYTHONPATH", "")] if p))
    out = subprocess.run([sys.executable, "-c", HOST_READS_SCRIPT, *map(str, (R, E, HG, K, M))], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


@gpu
@pytest.mark.gpu
def test_cuda_graph_low_latency_decode():
    """A decode step (LL dispatch, expert, combine) captured in a CUDA graph per rank and
    replayed with new routings written into the static inputs."""
    steps = [make_inputs(50 + i, R, E, HG, K, [M] * R) for i in range(3)]
    scale = torch.rand(E, HG) + 0.5
    barrier = threading.Barrier(R)

    def rank(world, r):
        dev = torch.device("cuda", 0)
        sc = scale[r * L:(r + 1) * L].to(dev)
        with world.comm(r, **CFG_GPU) as comm, comm.handle("ll") as h:
            xs, idxs, ws = steps[0]
            sx = torch.tensor(xs[r], device=dev).to(torch.bfloat16)
            si = torch.tensor(idxs[r], device=dev)
            sw = torch.tensor(ws[r], device=dev)

            def step():
                res = h.dispatch(sx, si, sw)
                y = (res.recv_x.float() * sc[:, None, :]).to(torch.bfloat16)
                return h.combine(y)

            s = torch.cuda.current_stream(dev)  # World.run's, prepared: torch allocates on it
            step()  # warm-up outside the graph (sizes the handle's buffers)
            s.synchronize()
            barrier.wait()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                out = step()
            barrier.wait()
            outs = []
            for xs, idxs, ws in steps:
                sx.copy_(torch.tensor(xs[r]).to(torch.bfloat16))
                si.copy_(torch.tensor(idxs[r]))
                sw.copy_(torch.tensor(ws[r]))
                g.replay()
                s.synchronize()
                outs.append(out.cpu())
                barrier.wait()
            comm.synchronize()
            return outs

    with epx.World(R, backend="cuda", devices=[0] * R) as world:
        got = world.run(lambda r: rank(world, r))
    for i, (xs, idxs, ws) in enumerate(steps):
        for r in range(R):
            x = torch.tensor(xs[r]).to(torch.bfloat16).double()
            want = torch.zeros(M, HG, dtype=torch.float64)
            for t in range(M):
                for k in range(K):
                    e = int(idxs[r][t, k])
                    if e >= 0:
                        want[t] += float(ws[r][t, k]) * (x[t] * scale[e].double())
            torch.testing.assert_close(got[r][i].double(), want, rtol=2e-2, atol=5e-2)
