"""Handle: the plan of one dispatch, and the dispatch and combine that use it.

Arrays are numpy arrays (CPU backend) or torch tensors (CPU tensors to the CPU backend, CUDA
tensors to the CUDA backend; see :mod:`epx.torch`). Shapes and dtypes are checked here before
anything reaches C, and every failure raises an :class:`Error` subclass; a rank whose arguments
fail those checks still takes part in the collective it refused (:mod:`epx.collective`), so its
peers fail at once, naming it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any, Optional

import numpy as np

from . import _lib
from ._lib import Algo, DType, Status
from ._lib import Layout as _LayoutKind
from .arrays import _device_check, _frontend_of, _input, _output
from .collective import _Collective
from .comm import Comm
from .config import _parse_algo, _parse_layout
from .dtypes import _parse_float_dtype
from .errors import UnsupportedError, _arg_error, _check, _dtype_error, _raise, _shape_error
from .results import DispatchResult, HandleInfo, NodeTraffic
from .routing import _routing
from .world import _Owned


class Handle(_Owned):
    """The plan of one dispatch, reused by combine and by both backward passes.

    ``algo``: 'ht' (high-throughput: training, prefill), 'll' (low-latency, fixed shapes:
    decode, CUDA graphs; always the expert layout) or 'alltoall' (baseline). ``layout``:
    'token' (one row per received token) or 'expert' (one row per (token, local expert),
    grouped by local expert, each block padded to ``align`` rows). ``exact`` (CUDA): notify
    waits for the counts so outputs can be sized exactly; ``False`` is sync-free.

    ``recv_budget`` (expert layout of 'ht'): at most that many rows arrive on this rank; pairs
    past it are dropped by the contract's rule (docs/design.md, "Receive budget") and
    ``DispatchResult.dropped`` ([1] int32, on the device with CUDA tensors) counts the pairs
    the whole group dropped. Both backends drop the same pairs.

    Re-plan it with new routings as often as you like (``notify`` or ``dispatch`` with a
    routing). ``plan_id`` counts the plans, so a backward pass can tell the plan it needs is
    still the handle's.
    """

    def __init__(self, comm: Comm, algo="ht", layout="token", align: int = 1, exact: bool = True,
                 recv_budget: int = 0):
        self._ptr = None
        lib = _lib.load()
        # creation is local, but the comm numbers its handles, failed ones too, and every call
        # carries the number: a refusal here is counted as libepx counts its own
        with _Collective(None, lambda: _count_refused_handle(comm)) as op:
            hc = _lib.HandleConfig()
            lib.epx_handle_config_init(ctypes.byref(hc))
            hc.algo = int(_parse_algo(algo))
            hc.layout = int(_parse_layout(layout))
            if not isinstance(align, (int, np.integer)) or align < 1:
                _arg_error(f"align must be an int >= 1, got {align!r}")
            hc.align = int(align)
            hc.exact = 1 if exact else 0
            if not isinstance(recv_budget, (int, np.integer)) or recv_budget < 0:
                _arg_error(f"recv_budget must be an int >= 0, got {recv_budget!r}")
            hc.recv_budget = int(recv_budget)
            self.recv_budget = int(recv_budget)
            self.comm = comm
            self._algo = Algo(hc.algo)
            self._layout = _LayoutKind.EXPERT if self._algo == Algo.LL else _LayoutKind(hc.layout)
            self._align = 1 if self._algo == Algo.LL else int(align)
            self._exact = bool(exact)
            self._num_tokens: Optional[int] = None
            self._rows: Optional[int] = None  # rows of the last plan, when known on the host
            self.plan_id = 0
            p = ctypes.c_void_p()
            st = op.call(lambda: lib.epx_handle_create(comm._p(), ctypes.byref(hc), ctypes.byref(p)), None)
            _check(st, "epx_handle_create")
        self._ptr = p
        with comm.world._lock:
            comm._handles.add(self)
            comm._open_handles += 1

    # -- properties --------------------------------------------------------------------------
    @property
    def algo(self) -> str:
        return self._algo.name.lower()

    @property
    def layout(self) -> str:
        return self._layout.name.lower()

    @property
    def align(self) -> int:
        return self._align

    @property
    def exact(self) -> bool:
        return self._exact

    @property
    def planned(self) -> bool:
        return self._num_tokens is not None

    @property
    def num_tokens(self) -> Optional[int]:
        """T of the last plan (None before the first)."""
        return self._num_tokens

    @property
    def ll_rows(self) -> int:
        """Low-latency: rows per local expert block, R * max_tokens_per_rank."""
        return self.comm.nranks * self.comm._config.max_tokens_per_rank

    def _p(self):
        if self._ptr is None:
            _raise(Status.INVALID_ARGUMENT, "the handle is closed")
        return self._ptr

    def _planned(self, T):
        self._num_tokens = int(T)
        self.plan_id += 1

    # -- notify / info -------------------------------------------------------------------------
    def notify(self, topk_idx=None, topk_weights=None, *, routing_map=None, probs=None) -> None:
        """Collective: plans a dispatch of this routing (layout, count exchange, positions).
        Validates every expert id (:class:`ExpertOutOfRangeError` on every rank); low-latency
        mode refuses more than max_tokens_per_rank tokens (:class:`LowLatencyOverflowError`)."""
        fe = _frontend_of(topk_idx, routing_map)
        with _Collective(self.comm, self._refuse_notify, fe) as op:
            r, keep, T = _routing(fe, self.comm, topk_idx, topk_weights, routing_map, probs)
            self._num_tokens = None
            self._rows = None
            st = op.call(lambda: _lib.load().epx_notify(self.comm._p(), self._p(), ctypes.byref(r)), keep[0][1])
            _check(st, "epx_notify")
        # CUDA low-latency handles plan inside the dispatch that follows: the routing (and
        # any converted copy of it) must live until then.
        self._routing_keep = keep
        self._planned(T)

    # -- refusals: the C call the peers are in, with arguments it refuses (epx.collective) ----
    # The arguments are refused by their own form (a negative token count, a struct never set
    # up: struct_size 0), so the peers learn this rank's status, EPX_ERR_INVALID_ARGUMENT, the
    # status of every Python check's error; NULL arguments would take part as well, as
    # EPX_ERR_NULL_POINTER.
    def _refuse_notify(self) -> int:
        self._num_tokens = self._rows = None  # as on the peers, whose notify fails
        return _lib.load().epx_notify(self.comm._ptr, self._ptr, ctypes.byref(_refused_routing()))

    def _dispatch_refusal(self, routed: bool, recv_x_given: bool):
        """The refusal of a dispatch (``routed``: with a routing): the C call its peers make
        first, which the refusal must be (backends that compare the operation on the device
        would find another one out of step): epx_notify where the dispatch plans apart."""
        if routed and not recv_x_given and self._plans_in_notify():
            return self._refuse_notify
        return functools.partial(self._refuse_dispatch, routed)

    def _plans_in_notify(self) -> bool:
        """Whether a dispatch with a routing that sizes its own outputs plans in an epx_notify
        of its own first, then sizes them exactly: where the host can know the counts."""
        return self._algo != Algo.LL and (self._exact or self.comm.backend == "host")

    def _refuse_dispatch(self, plans: bool) -> int:
        """``plans``: the peers' dispatch plans (it has a routing): the refusal drops this
        rank's plan, as theirs fail."""
        r = None
        if plans:
            self._num_tokens = self._rows = None
            r = ctypes.byref(_refused_routing())
        return _lib.load().epx_dispatch(self.comm._ptr, self._ptr, r, ctypes.byref(_lib.DispatchArgs()))

    def _refuse_combine(self) -> int:
        return _lib.load().epx_combine(self.comm._ptr, self._ptr, ctypes.byref(_lib.CombineArgs()))

    def info(self) -> HandleInfo:
        """Host-side sizes of the last plan (UnsupportedError in CUDA sync-free mode)."""
        L = self.comm.num_local_experts
        counts = np.zeros(L, np.int32)
        inf = _lib.HandleInfo()
        _check(_lib.load().epx_handle_info(self._p(), ctypes.byref(inf), counts.ctypes.data), "epx_handle_info")
        return HandleInfo(inf.num_send_tokens, inf.num_recv_tokens, inf.num_recv_rows, inf.num_recv_pairs,
                          inf.num_sent_copies, counts)

    def node_traffic(self) -> NodeTraffic:
        """Bytes that crossed node boundaries into this rank in the last dispatch and combine
        (config.ranks_per_node), next to what one crossing per destination rank would move."""
        t = _lib.NodeTraffic()
        _check(_lib.load().epx_handle_node_traffic(self._p(), ctypes.byref(t)), "epx_handle_node_traffic")
        return NodeTraffic(t.dispatch_bytes, t.combine_bytes, t.dispatch_bytes_per_rank, t.combine_bytes_per_rank)

    def _host_rows(self) -> Optional[int]:
        """Rows of the current plan's receive buffer, or None when only the device knows."""
        if self._algo == Algo.LL:
            return self.comm.num_local_experts * self.ll_rows
        try:
            return int(self.info().num_recv_rows)
        except UnsupportedError:
            return None

    def _bound_rows(self) -> int:
        """Upper bound on receive rows (sync-free CUDA): from max_tokens_per_rank."""
        c = self.comm
        M, R, K, L = c._config.max_tokens_per_rank, c.nranks, c.topk, c.num_local_experts
        if self._layout == _LayoutKind.TOKEN:
            return R * M
        return R * M * min(K, L) + L * (self._align - 1)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, routing_map=None, probs=None, recv_dtype=None,
                 recv_x=None, recv_scales=None, scale_by_probs: bool = False) -> DispatchResult:
        """Collective: sends each row of ``x [T, H]`` to the ranks of its experts.

        With a routing (either form) it plans first; without one it replays the last plan
        (that is combine's gradient: pass the output gradient as ``x``). Outputs are allocated
        here, sized exactly from the plan (the host knows the counts; low-latency buffers are
        fixed ``[L, R*M, H]``), unless ``recv_x`` (and for fp8 ``recv_scales``) is given: then
        its first dimension is the capacity (:class:`OutputTooSmallError` when rows don't fit)
        and the plan and the dispatch are one call.

        ``recv_dtype``: None (x's type) or 'fp8' (e4m3 with a float32 scale per 128
        channels). ``scale_by_probs`` (expert layout): multiply each row by its weight.
        """
        fe = _frontend_of(x, topk_idx, routing_map)
        replay = topk_idx is None and routing_map is None
        with _Collective(self.comm, self._dispatch_refusal(not replay, recv_x is not None), fe) as op:
            x, x_code, r_code, dev = self._dispatch_input(fe, x, replay, topk_weights, probs, recv_dtype,
                                                          scale_by_probs)
            routing, keep, T = None, None, self._num_tokens
            if not replay:
                routing, keep, T = _routing(fe, self.comm, topk_idx, topk_weights, routing_map, probs)
            if fe.shape(x)[0] != T:
                what = "the routing" if not replay else "the handle's last plan"
                _shape_error(f"x has {fe.shape(x)[0]} rows but {what} has {T} tokens")
            if recv_x is not None:
                out = self._given_recv_x(fe, recv_x, r_code)
            else:
                routing, out = self._sized_recv_x(op, dev, routing, T, r_code, like=x)
            self._recv_scales(fe, out, recv_scales, r_code, dev)
            self._side_outputs(fe, out, dev)
            self._dispatch_call(op, dev, routing, T, x, x_code, r_code, out, scale_by_probs)
        del keep
        return self._dispatch_result(fe, out, r_code)

    # -- the steps of a dispatch ---------------------------------------------------------------
    def _dispatch_input(self, fe, x, replay, topk_weights, probs, recv_dtype, scale_by_probs):
        """Checks what a dispatch sends: returns (x, its dtype, the receive dtype, x's device)."""
        H = self.comm.hidden
        if replay and (topk_weights is not None or probs is not None):
            _arg_error("weights or probs without topk_idx / routing_map")
        if replay and not self.planned:
            _arg_error("the handle has no plan yet: pass a routing (topk_idx or routing_map) or call notify()")
        x, x_code = _input(fe, x, "x", (DType.FLOAT32, DType.BFLOAT16), 2)
        dev = _device_check(fe, self.comm, x, "x")
        if fe.shape(x)[1] != H:
            _shape_error(f"x has hidden size {fe.shape(x)[1]} but the comm's hidden is {H}")
        if recv_dtype is None:
            r_code = x_code
        else:
            r_code = _parse_float_dtype(recv_dtype)
            if r_code not in (x_code, DType.FP8_E4M3):
                _dtype_error(f"recv_dtype must be x's type ({x_code.name.lower()}) or fp8, not {r_code.name.lower()}")
        if scale_by_probs and self._layout == _LayoutKind.TOKEN:
            _arg_error("scale_by_probs needs the expert layout (or low-latency)")
        return x, x_code, r_code, dev

    def _given_recv_x(self, fe, recv_x, r_code) -> "_DispatchOutputs":
        """The caller's receive buffer: its first dimension is the capacity (low-latency: the
        fixed [L, R*M, H], or flat [L*R*M, H])."""
        c = self.comm
        H, L = c.hidden, c.num_local_experts
        ll = self._algo == Algo.LL
        if ll:
            want = (L, self.ll_rows, H)
            if tuple(fe.shape(recv_x)) == (L * self.ll_rows, H):
                want = (L * self.ll_rows, H)
        else:
            s = fe.shape(recv_x)
            if len(s) != 2 or s[1] != H:
                _shape_error(f"recv_x must be [capacity, {H}], got {tuple(s)}")
            want = s
        _output(fe, recv_x, "recv_x", want, (r_code,))
        _device_check(fe, c, recv_x, "recv_x")
        cap = L * self.ll_rows if ll else fe.shape(recv_x)[0]
        return _DispatchOutputs(recv_x=recv_x, cap=cap, rows_known=None)

    def _sized_recv_x(self, op, dev, routing, T, r_code, like):
        """Allocates the receive buffer. Exact sizes where the host can know them: plan first
        (the CPU backend always knows the counts; CUDA in exact mode waits for them), then size
        the outputs. CUDA sync-free: one call, outputs sized for the worst case of the config.
        Returns (the routing still to plan, or None when planned here; the outputs)."""
        c, fe = self.comm, op.fe
        H, L = c.hidden, c.num_local_experts
        rows_known = None
        if self._algo == Algo.LL:
            cap = L * self.ll_rows
            shape = (L, self.ll_rows, H)
        else:
            if routing is not None and self._plans_in_notify():
                self._num_tokens = None
                st = op.call(lambda: _lib.load().epx_notify(c._p(), self._p(), ctypes.byref(routing)), dev, last=False)
                _check(st, "epx_notify")
                self._planned(T)
                op.refuse = functools.partial(self._refuse_dispatch, False)  # the peers go on to dispatch this plan
                routing = None
            cap = self._host_rows() if routing is None else None
            if cap is None:
                cap = self._bound_rows()
            else:
                rows_known = cap
            shape = (cap, H)
        recv_x = fe.alloc(shape, r_code, like=like, device=dev, zero=True)
        return routing, _DispatchOutputs(recv_x=recv_x, cap=cap, rows_known=rows_known)

    def _lead(self, cap) -> tuple:
        """The leading dimensions of per-row outputs (low-latency: [L, R*M])."""
        return (self.comm.num_local_experts, self.ll_rows) if self._algo == Algo.LL else (cap,)

    def _recv_scales(self, fe, out, recv_scales, r_code, dev) -> None:
        """fp8: the float32 scale per 128-channel block of each row, given or allocated."""
        blocks = (self.comm.hidden + _lib.FP8_BLOCK - 1) // _lib.FP8_BLOCK
        lead = self._lead(out.cap)
        if r_code == DType.FP8_E4M3:
            if recv_scales is None:
                recv_scales = fe.alloc(lead + (blocks,), DType.FLOAT32, device=dev, zero=True)
            else:
                ok = (tuple(fe.shape(recv_scales)) in (lead + (blocks,), (out.cap, blocks)))
                if not ok:
                    _shape_error(f"recv_scales has shape {tuple(fe.shape(recv_scales))}, expected {lead + (blocks,)}")
                _output(fe, recv_scales, "recv_scales", None, (DType.FLOAT32,))
                _device_check(fe, self.comm, recv_scales, "recv_scales")
            out.recv_scales = recv_scales
        elif recv_scales is not None:
            _arg_error("recv_scales is for fp8 dispatch only")

    def _side_outputs(self, fe, out, dev) -> None:
        """The per-row outputs besides the rows: top-k ids and weights (token layout) or each
        row's weight (expert layout), the counts per local expert and the rows written."""
        K, L = self.comm.topk, self.comm.num_local_experts
        cap, unknown = out.cap, out.rows_known is None
        if self._layout == _LayoutKind.TOKEN:
            # rows past the received count (unknown on the host in sync-free mode) read as "no
            # expert" rather than as garbage ids
            out.topk_idx = fe.alloc((cap, K), DType.INT32, device=dev, zero=False)
            if unknown:
                out.topk_idx[...] = -1
            out.topk_weights = fe.alloc((cap, K), DType.FLOAT32, device=dev, zero=unknown)
        else:
            out.probs = fe.alloc(self._lead(cap), DType.FLOAT32, device=dev, zero=True)
        out.counts = fe.alloc((L,), DType.INT32, device=dev, zero=True)
        out.nrows = fe.alloc((1,), DType.INT64, device=dev, zero=True)
        out.dropped = fe.alloc((1,), DType.INT32, device=dev, zero=True)

    def _dispatch_call(self, op, dev, routing, T, x, x_code, r_code, out, scale_by_probs) -> None:
        """epx_dispatch itself (planning first when ``routing`` is given)."""
        lib = _lib.load()
        c, fe = self.comm, op.fe
        a = _lib.DispatchArgs()
        lib.epx_dispatch_args_init(ctypes.byref(a))
        a.x = fe.ptr(x)
        a.x_dtype = int(x_code)
        a.recv_dtype = int(r_code)
        a.recv_x = fe.ptr(out.recv_x)
        a.recv_scales = fe.ptr(out.recv_scales) if out.recv_scales is not None else None
        a.recv_capacity = int(out.cap)
        a.recv_topk_idx = fe.ptr(out.topk_idx) if out.topk_idx is not None else None
        a.recv_topk_weights = fe.ptr(out.topk_weights) if out.topk_weights is not None else None
        a.recv_probs = fe.ptr(out.probs) if out.probs is not None else None
        a.tokens_per_local_expert = fe.ptr(out.counts)
        a.num_recv_rows = fe.ptr(out.nrows)
        a.scale_by_probs = 1 if scale_by_probs else 0
        a.dropped = fe.ptr(out.dropped)
        if routing is not None:
            self._num_tokens = None
            self._rows = None
        rp = ctypes.byref(routing) if routing is not None else None
        st = op.call(lambda: lib.epx_dispatch(c._p(), self._p(), rp, ctypes.byref(a)), dev)
        if routing is not None and st in (Status.SUCCESS, Status.OUTPUT_TOO_SMALL):
            self._planned(T)  # (too small: the plan stands, only this output could not take it)
        _check(st, "epx_dispatch")

    def _dispatch_result(self, fe, out, r_code) -> DispatchResult:
        """The outputs as a DispatchResult, cut to the rows written where the host knows them."""
        ll = self._algo == Algo.LL
        rows_known = out.rows_known
        written = fe.host_int(out.nrows)  # None where only the device knows (CUDA tensors)
        if not ll and written is not None:
            rows_known = written
        self._rows = self.comm.num_local_experts * self.ll_rows if ll else rows_known
        res = DispatchResult(recv_x=out.recv_x, recv_scales=out.recv_scales if r_code == DType.FP8_E4M3 else None,
                             recv_topk_idx=out.topk_idx, recv_topk_weights=out.topk_weights, recv_probs=out.probs,
                             tokens_per_local_expert=out.counts, num_rows=written if ll else rows_known,
                             layout=self.layout, algo=self.algo, align=self._align)
        if rows_known is not None and not ll and rows_known < out.cap:
            # The caller's buffer had room to spare: hand back the rows that were written.
            for f in ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_probs"):
                v = getattr(res, f)
                if v is not None:
                    setattr(res, f, fe.slice_rows(v, rows_known))
        res._num_recv_rows_buf = out.nrows
        res.dropped = out.dropped  # [1] int32: pairs the group dropped past its receive budgets
        self._last_counts = out.counts  # (low-latency backward masks rows past the counts)
        return res

    # -- combine -----------------------------------------------------------------------------
    def combine(self, y, *, out=None, out_dtype=None, weighted: bool = True, row_probs=None, row_weight_grad=None):
        """Collective: the inverse of the handle's dispatch; returns ``out [T, H]``.

        ``y`` holds the rows of the handle's layout (token ``[N, H]``, expert ``[rows, H]``,
        low-latency ``[L, R*M, H]``), float32 or bfloat16. Token layout: ``out[t]`` is the
        float32 sum of its rows over destination ranks, rounded once. Expert layout: each
        destination sums its rows times their weight (``weighted``; ``row_probs`` overrides the
        weights dispatch delivered) per token, then the source sums the partials.

        ``row_weight_grad`` (token layout ``[N, K]``, expert ``[rows]``): sends each value back to
        its topk slot; then the call returns ``(out, topk_weight_grad [T, K])``.
        """
        fe = _frontend_of(y)
        with _Collective(self.comm, self._refuse_combine, fe) as op:
            if not self.planned:
                _arg_error("the handle has no plan yet: dispatch before combine")
            y, y_code, dev, lead = self._combine_rows(fe, y)
            out, o_code = self._combine_out(fe, y, y_code, dev, out, out_dtype)
            rp, rwg, twg = self._row_extras(fe, dev, lead, row_probs, row_weight_grad)
            a = _lib.CombineArgs()
            _lib.load().epx_combine_args_init(ctypes.byref(a))
            a.y = fe.ptr(y)
            a.y_dtype = int(y_code)
            a.out = fe.ptr(out)
            a.out_dtype = int(o_code)
            a.weighted = 1 if weighted else 0
            a.row_probs = fe.ptr(rp) if rp is not None else None
            a.row_weight_grad = fe.ptr(rwg) if rwg is not None else None
            a.topk_weight_grad = fe.ptr(twg) if twg is not None else None
            st = op.call(lambda: _lib.load().epx_combine(self.comm._p(), self._p(), ctypes.byref(a)), dev)
            _check(st, "epx_combine")
        return out if twg is None else (out, twg)

    def _combine_out(self, fe, y, y_code, dev, out, out_dtype):
        """The output combine writes ``[T, H]``, given (checked) or allocated: returns (out, its dtype)."""
        T, H = self._num_tokens, self.comm.hidden
        o_code = y_code if out_dtype is None else _parse_float_dtype(out_dtype)
        if o_code not in (DType.FLOAT32, DType.BFLOAT16):
            _dtype_error("out_dtype must be float32 or bfloat16")
        if out is None:
            return fe.alloc((T, H), o_code, like=y, device=dev, zero=False), o_code
        o_code = _output(fe, out, "out", (T, H), (DType.FLOAT32, DType.BFLOAT16))
        _device_check(fe, self.comm, out, "out")
        return out, o_code

    def _combine_rows(self, fe, y):
        """Checks the rows combine takes: returns (y, its dtype, its device, the leading
        dimensions of per-row arrays)."""
        c = self.comm
        H, L = c.hidden, c.num_local_experts
        y, y_code = _input(fe, y, "y", (DType.FLOAT32, DType.BFLOAT16), (2, 3))
        dev = _device_check(fe, c, y, "y")
        ys = tuple(fe.shape(y))
        if self._algo == Algo.LL:
            if ys not in ((L, self.ll_rows, H), (L * self.ll_rows, H)):
                _shape_error(f"y must be [{L}, {self.ll_rows}, {H}] in low-latency mode, got {ys}")
            lead = (L, self.ll_rows) if len(ys) == 3 else (L * self.ll_rows,)
        else:
            if len(ys) != 2 or ys[1] != H:
                _shape_error(f"y must be [rows, {H}], got {ys}")
            if self._rows is not None and ys[0] < self._rows:
                _shape_error(f"y has {ys[0]} rows but the plan has {self._rows}")
            lead = (ys[0],)
        return y, y_code, dev, lead

    def _row_extras(self, fe, dev, lead, row_probs, row_weight_grad):
        """The optional per-row inputs of combine, checked against the rows' shape ``lead``:
        returns (row_probs, row_weight_grad, the topk_weight_grad [T, K] output or None)."""
        c = self.comm
        K, T = c.topk, self._num_tokens
        token = self._layout == _LayoutKind.TOKEN
        rp = None
        if row_probs is not None:
            if token:
                _arg_error("row_probs is for the expert layout (token layout rows are summed unweighted)")
            rp, _ = _input(fe, row_probs, "row_probs", (DType.FLOAT32,), None, DType.FLOAT32)
            if tuple(fe.shape(rp)) not in (lead, (int(np.prod(lead)),)):
                _shape_error(f"row_probs has shape {tuple(fe.shape(rp))}, expected {lead}")
            _device_check(fe, c, rp, "row_probs")
        rwg = twg = None
        if row_weight_grad is not None:
            want = lead + (K,) if token else lead
            rwg, _ = _input(fe, row_weight_grad, "row_weight_grad", (DType.FLOAT32,), None, DType.FLOAT32)
            flat = (int(np.prod(want[:-1])), K) if token else (int(np.prod(want)),)
            if tuple(fe.shape(rwg)) not in (want, flat):
                _shape_error(f"row_weight_grad has shape {tuple(fe.shape(rwg))}, expected {want}")
            _device_check(fe, c, rwg, "row_weight_grad")
            twg = fe.alloc((T, K), DType.FLOAT32, device=dev, zero=True)
        return rp, rwg, twg

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._ptr is None:
            return
        ptr, self._ptr = self._ptr, None
        with self.comm.world._lock:
            self.comm._handles.discard(self)
            self.comm._open_handles -= 1
        _check(_lib.load().epx_handle_destroy(ptr), "epx_handle_destroy")


    def __repr__(self):
        return (f"<epx.Handle {self.algo} {self.layout} align={self._align} rank {self.comm.rank}"
                f"{' planned T=' + str(self._num_tokens) if self.planned else ''}>")


def _count_refused_handle(comm) -> int:
    """epx_handle_create without a config: refused (EPX_ERR_NULL_POINTER), and counted."""
    return _lib.load().epx_handle_create(comm._ptr, None, ctypes.byref(ctypes.c_void_p()))


def _refused_routing() -> _lib.Routing:
    """A routing every call refuses (EPX_ERR_INVALID_ARGUMENT): -1 tokens."""
    r = _lib.Routing()
    r.num_tokens = -1
    return r


@dataclasses.dataclass
class _DispatchOutputs:
    """The outputs of one dispatch call, as epx_dispatch takes them."""

    recv_x: Any
    cap: int  # recv_capacity: rows recv_x holds
    rows_known: Optional[int]  # rows that arrive, when the host knows them before the call
    recv_scales: Any = None
    topk_idx: Any = None
    topk_weights: Any = None
    probs: Any = None
    counts: Any = None
    nrows: Any = None
    dropped: Any = None
