"""PyTorch integration: tensors in, autograd through dispatch and combine, a Megatron-style
token dispatcher, and process-group bootstrap.

torch is imported when this module is (``import epx`` alone never imports it).

Tensors
    CPU tensors go to the CPU ('host') backend, CUDA tensors to the CUDA backend; every call
    first points the comm at ``torch.cuda.current_stream(device)`` (``epx_comm_set_stream``),
    so epx's work is ordered with the surrounding torch work and can be captured in a CUDA
    graph. :class:`epx.Handle` methods accept tensors directly (no autograd); the functions
    below add autograd.

Autograd
    :func:`dispatch` / :class:`DispatchFunction`: the gradient of dispatch is a combine of the
    gradients with the same handle (unweighted), and the weight gradients travel back to their
    top-k slots (``row_weight_grad`` -> ``topk_weight_grad``).
    :func:`combine` / :class:`CombineFunction`: the gradient of combine is a replay of the
    handle's dispatch (``epx_dispatch(comm, handle, NULL, ...)``) of the output gradient: in the
    expert layout the rows come back multiplied by their probabilities, and the probability
    gradient of a row is ``dot(y_row, grad_out_row)``.
    Backward passes are collectives too: every rank must run its backward (each on its own
    thread for a local world; :meth:`epx.World.run` does that). A handle must not be re-planned
    between a forward and its backward: the functions check ``handle.plan_id`` and raise.

:class:`FlexTokenDispatcher`
    Megatron-LM's six steps (``dispatch_preprocess``, ``token_dispatch``,
    ``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``,
    ``combine_postprocess``) over epx's expert layout: the tokens come back grouped by local
    expert with ``tokens_per_expert`` for a grouped GEMM. One algorithm per mode ('ht' for
    training and prefill, 'll' for decode, or 'alltoall'); ``set_mode('decode')`` switches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import numpy as np
import torch

from ._lib import DType, Status
from .comm import Comm
from .config import _parse_algo
from .errors import DeviceError, TopkRangeError, UnsupportedError, _arg_error, _dtype_error, _shape_error
from .frontend import _Frontend, _dtype_codes
from .handle import Handle
from .results import DispatchResult
from .world import World

__all__ = [
    "dispatch", "combine", "DispatchFunction", "CombineFunction", "FlexTokenDispatcher", "map_to_topk",
    "topk_to_map", "world_from_torch_distributed",
]

# =============================================================================================
# The torch frontend (same interface as epx.numpy_frontend._NumpyFrontend)
# =============================================================================================

_TORCH_OF = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
    DType.BOOL: torch.bool,
}
_FP8 = getattr(torch, "float8_e4m3fn", None)
# uint8 is a bool map or fp8 bits
_TORCH_CODES = [(torch.float32, (DType.FLOAT32,)), (torch.bfloat16, (DType.BFLOAT16,)), (_FP8, (DType.FP8_E4M3,)),
                (torch.uint8, (DType.BOOL, DType.FP8_E4M3)), (torch.bool, (DType.BOOL,)),
                (torch.int32, (DType.INT32,)), (torch.int64, (DType.INT64,))]
if _FP8 is not None:
    _TORCH_OF[DType.FP8_E4M3] = _FP8


class _TorchFrontend(_Frontend):
    name = "torch"

    @staticmethod
    def is_array(a) -> bool:
        return isinstance(a, torch.Tensor)

    @staticmethod
    def codes(a):
        return _dtype_codes(a.dtype, _TORCH_CODES)

    @staticmethod
    def dtype_name(a) -> str:
        return str(a.dtype)

    @staticmethod
    def device(a) -> str:
        d = a.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{d.index if d.index is not None else torch.cuda.current_device()}"

    @staticmethod
    def shape(a) -> tuple:
        return tuple(a.shape)

    @staticmethod
    def ptr(a):
        """The data pointer; never NULL for an empty tensor (whose data_ptr() is 0, which the
        library reads as 'not given'): 16 spare bytes on the same device stand in."""
        if a is None:
            return None
        if a.numel():
            return a.data_ptr()
        key = str(a.device)
        spare = _SPARE.get(key)
        if spare is None:
            spare = _SPARE[key] = torch.zeros(16, dtype=torch.uint8, device=a.device)
        return spare.data_ptr()

    @staticmethod
    def contiguous(a):
        return a.detach().contiguous()

    @staticmethod
    def is_contiguous_writable(a) -> bool:
        return a.is_contiguous()

    @staticmethod
    def convert(a, code):
        fl = a.is_floating_point()
        integral = not fl and not a.is_complex() and a.dtype != torch.bool
        if code == DType.FLOAT32 and fl:
            return a.detach().to(torch.float32)
        if code == DType.INT64 and integral:
            return a.detach().to(torch.int64)
        if code == DType.BOOL and not a.is_complex():
            return a.detach() != 0
        return None

    @staticmethod
    def alloc(shape, code, like=None, device=None, zero=True):
        dt = _TORCH_OF.get(code)
        if dt is None:
            _dtype_error(f"this torch has no dtype for {code.name.lower()}")
        dev = torch.device(device or "cpu")
        return torch.zeros(shape, dtype=dt, device=dev) if zero else torch.empty(shape, dtype=dt, device=dev)

    @staticmethod
    @contextlib.contextmanager
    def on_stream(comm, device):
        """Around one C call on CUDA tensors: the comm works on the caller's current stream.
        The legacy default stream (torch's default) cannot host epx's work when ranks share a
        GPU (it would serialise kernels that wait on each other), so then the work goes to a
        side stream of the comm, fenced both ways with the current stream."""
        if not device or not device.startswith("cuda"):
            yield
            return
        dev = torch.device(device)
        cur = torch.cuda.current_stream(dev)
        if cur.cuda_stream != 0:
            comm.set_stream(cur.cuda_stream)
            yield
            return
        if comm.world.shares_device(comm.rank):
            raise DeviceError(Status.INVALID_ARGUMENT,
                              f"rank {comm.rank} shares {device} with other ranks of this process but runs on "
                              "torch's default stream, which would queue the ranks behind each other: run the "
                              "ranks through World.run, or give each its own stream (torch.cuda.stream(...))")
        side = getattr(comm, "_torch_side_streams", {}).get(device)
        if side is None:
            side = torch.cuda.Stream(device=dev)
            comm.__dict__.setdefault("_torch_side_streams", {})[device] = side
        side.wait_stream(cur)
        comm.set_stream(side.cuda_stream)
        try:
            yield
        finally:
            cur.wait_stream(side)

    @staticmethod
    def host_int(a) -> Optional[int]:
        return int(a.reshape(-1)[0]) if a.device.type == "cpu" else None


_SPARE: Dict[str, "torch.Tensor"] = {}
_TORCH = _TorchFrontend()


# =============================================================================================
# Routing helpers (torch-native: any device, differentiable in the weights)
# =============================================================================================


def map_to_topk(routing_map: torch.Tensor, probs: Optional[torch.Tensor], topk: int, check: Optional[bool] = None):
    """Multi-hot ``routing_map [T, E]`` (+ ``probs [T, E]``) -> ``(topk_idx int64 [T, K],
    topk_weights float32 [T, K])``, slots in ascending expert id padded with -1 / 0, exactly
    like ``epx_map_to_topk``. Differentiable in ``probs`` (a gather). ``check`` (default: on
    CPU always, on CUDA unless a graph is being captured) raises :class:`epx.TopkRangeError`
    for a row with more than ``topk`` experts; it reads a count back to the host."""
    if routing_map.dim() != 2:
        _shape_error(f"routing_map must be [T, E], got {tuple(routing_map.shape)}")
    T, E = routing_map.shape
    m = routing_map if routing_map.dtype == torch.bool else routing_map != 0
    if check is None:
        check = m.device.type == "cpu" or not torch.cuda.is_current_stream_capturing()
    if check and T > 0:
        most = int(m.sum(dim=1).max())
        if most > topk:
            raise TopkRangeError(Status.TOPK_RANGE, f"a routing map row chooses {most} experts, more than topk = {topk}")
    ar = torch.arange(E, device=m.device, dtype=torch.int64)
    keys = torch.where(m, ar.expand(T, E), torch.full_like(ar, E).expand(T, E))
    if topk > E:
        keys = torch.cat([keys, torch.full((T, topk - E), E, dtype=torch.int64, device=m.device)], dim=1)
    first = keys.sort(dim=1).values[:, :topk]
    valid = first < E
    idx = torch.where(valid, first, torch.full_like(first, -1))
    if probs is None:
        w = valid.to(torch.float32)
    else:
        if tuple(probs.shape) != (T, E):
            _shape_error(f"probs has shape {tuple(probs.shape)}, expected {(T, E)}")
        w = probs.float().gather(1, idx.clamp(min=0)) * valid
    return idx, w


def topk_to_map(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], num_experts: int):
    """``topk_idx [T, K]`` (+ weights) -> ``(routing_map bool [T, E], probs float32 [T, E])``;
    differentiable in the weights. Ids are not validated here (epx does it in notify)."""
    T, K = topk_idx.shape
    idx = topk_idx.long()
    valid = idx >= 0
    w = valid.float() if topk_weights is None else topk_weights.float() * valid
    probs = torch.zeros(T, num_experts + 1, dtype=torch.float32, device=idx.device)
    slot = torch.where(valid, idx, torch.full_like(idx, num_experts))
    probs = probs.scatter_add(1, slot, w)[:, :num_experts]
    m = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=idx.device)
    m = m.scatter(1, slot, True)[:, :num_experts]
    return m, probs


# =============================================================================================
# Autograd functions
# =============================================================================================


def _check_plan(handle: Handle, plan_id: int, what: str):
    if handle.plan_id != plan_id:
        raise RuntimeError(
            f"epx {what} backward: the handle was re-planned (plan {handle.plan_id}, forward used plan {plan_id}); "
            "use one handle per forward that is in flight until its backward"
        )


class DispatchFunction(torch.autograd.Function):
    """``(recv_x, recv_weights, recv_topk_idx, tokens_per_local_expert) = apply(handle, x,
    topk_weights, topk_idx, recv_dtype, box)``; ``box`` (a dict or None) receives the whole
    :class:`epx.DispatchResult` under ``'result'`` (fp8 scales, num_rows). ``recv_weights`` is ``recv_topk_weights [N, K]`` in
    the token layout and ``recv_probs [rows]`` in the expert layout (both differentiable back
    to ``topk_weights``); ``recv_topk_idx`` is None in the expert layout."""

    @staticmethod
    def forward(ctx, handle: Handle, x, topk_weights, topk_idx, recv_dtype=None, box=None):
        res = handle.dispatch(x.detach(), topk_idx, None if topk_weights is None else topk_weights.detach(),
                              recv_dtype=recv_dtype)
        ctx.handle, ctx.plan_id = handle, handle.plan_id
        ctx.x_dtype = x.dtype
        ctx.recv_shape, ctx.recv_dtype = tuple(res.recv_x.shape), res.recv_x.dtype
        ctx.has_weights = topk_weights is not None
        token = handle.layout == "token"
        w = res.recv_topk_weights if token else res.recv_probs
        ridx = res.recv_topk_idx if token else None
        nondiff = [res.tokens_per_local_expert] + ([ridx] if ridx is not None else [])
        if res.recv_scales is not None:
            nondiff.append(res.recv_x)
        ctx.mark_non_differentiable(*nondiff)
        if box is not None:
            box["result"] = res
        return res.recv_x, w, ridx, res.tokens_per_local_expert

    @staticmethod
    def backward(ctx, g_recv_x, g_w, _g_idx, _g_counts):
        h: Handle = ctx.handle
        _check_plan(h, ctx.plan_id, "dispatch")
        need_x = ctx.needs_input_grad[1]
        need_w = ctx.has_weights and ctx.needs_input_grad[2] and g_w is not None
        if not need_x and not need_w:
            return None, None, None, None, None, None
        if g_recv_x is None:
            g_recv_x = torch.zeros(ctx.recv_shape, dtype=ctx.recv_dtype, device=g_w.device)
        if g_recv_x.dtype not in (torch.float32, torch.bfloat16):
            g_recv_x = g_recv_x.float()
        rwg = g_w.detach().float().contiguous() if need_w else None
        res = h.combine(g_recv_x.detach().contiguous(), out_dtype=ctx.x_dtype, weighted=False, row_weight_grad=rwg)
        gx, gw = res if rwg is not None else (res, None)
        return None, (gx if need_x else None), gw, None, None, None


class CombineFunction(torch.autograd.Function):
    """``out = apply(handle, y, row_probs, weighted, out_dtype)``. ``row_probs`` (expert layout,
    optional, differentiable): the weights to multiply rows by; None takes those dispatch
    delivered (not differentiable then)."""

    @staticmethod
    def forward(ctx, handle: Handle, y, row_probs=None, weighted=True, out_dtype=None):
        out = handle.combine(y.detach(), out_dtype=out_dtype, weighted=weighted,
                             row_probs=None if row_probs is None else row_probs.detach())
        ctx.handle, ctx.plan_id = handle, handle.plan_id
        ctx.weighted = bool(weighted) and handle.layout == "expert"
        ctx.y_shape, ctx.y_dtype = tuple(y.shape), y.dtype
        ctx.has_probs = row_probs is not None
        if ctx.weighted and row_probs is not None:
            ctx.save_for_backward(y.detach(), row_probs.detach())
        return out

    @staticmethod
    def backward(ctx, g_out):
        h: Handle = ctx.handle
        _check_plan(h, ctx.plan_id, "combine")
        need_y = ctx.needs_input_grad[1]
        need_p = ctx.has_probs and ctx.needs_input_grad[2]
        if not need_y and not need_p:
            return None, None, None, None, None
        g = g_out.detach().contiguous()
        if g.dtype not in (torch.float32, torch.bfloat16):
            g = g.float()
        gy = gp = None
        if not ctx.weighted or not ctx.has_probs:
            # Rows of the output gradient, multiplied by the delivered weights when weighted.
            rows = h.dispatch(g, scale_by_probs=ctx.weighted).recv_x
            gy = _fit_rows(rows, ctx.y_shape).to(ctx.y_dtype)
        else:
            y, p = ctx.saved_tensors
            rows = _fit_rows(h.dispatch(g).recv_x, ctx.y_shape).float()
            if h.algo == "ll":  # rows past each expert's count hold stale data in y: mask them
                valid = _ll_valid(h, rows)
                rows = rows * valid.unsqueeze(-1)
            pf = p.float().reshape(rows.shape[:-1])
            if need_y:
                gy = (rows * pf.unsqueeze(-1)).to(ctx.y_dtype)
            if need_p:
                yf = y.float().reshape(rows.shape)
                if h.algo == "ll":
                    yf = torch.where(valid.unsqueeze(-1), yf, torch.zeros_like(yf))
                gp = (rows * yf).sum(-1).reshape(p.shape)
        return None, (gy if need_y else None), gp, None, None


def _fit_rows(rows: torch.Tensor, shape) -> torch.Tensor:
    """The replayed rows in the shape of the forward's y (y may have had spare capacity)."""
    shape = tuple(shape)
    if tuple(rows.shape) == shape:
        return rows
    if rows.numel() == int(np.prod(shape)):
        return rows.reshape(shape)
    if rows.dim() == 2 and len(shape) == 2 and rows.shape[0] <= shape[0]:
        pad = torch.zeros((shape[0] - rows.shape[0], shape[1]), dtype=rows.dtype, device=rows.device)
        return torch.cat([rows, pad], 0)
    raise RuntimeError(f"epx: replayed rows {tuple(rows.shape)} do not fit y {shape}")


def _ll_valid(h: Handle, rows: torch.Tensor) -> torch.Tensor:
    """[L, R*M] mask of the rows that hold data in the last low-latency dispatch."""
    counts = h._last_counts
    cap = h.ll_rows
    ar = torch.arange(cap, device=rows.device)
    return (ar.unsqueeze(0) < counts.to(rows.device).long().unsqueeze(1)).reshape(rows.shape[:-1])


def dispatch(handle: Handle, x: torch.Tensor, topk_idx=None, topk_weights=None, *, routing_map=None, probs=None,
             recv_dtype=None) -> DispatchResult:
    """Autograd-aware :meth:`epx.Handle.dispatch` of tensors (routing in either form; a
    routing map is turned into top-k slots in torch so ``probs`` stays differentiable).
    Returns a :class:`epx.DispatchResult` whose ``recv_x`` and ``recv_topk_weights`` /
    ``recv_probs`` carry gradients back to ``x`` and the weights. fp8 dispatch is
    forward-only."""
    if routing_map is not None:
        if topk_idx is not None or topk_weights is not None:
            _arg_error("pass topk_idx (+ topk_weights) or routing_map (+ probs), not both")
        topk_idx, topk_weights = map_to_topk(routing_map, probs, handle.comm.topk)
    elif probs is not None:
        _arg_error("probs goes with routing_map; with topk_idx pass topk_weights")
    if topk_idx is None:
        _arg_error("a routing is required (the autograd path always plans)")
    fp8 = recv_dtype is not None and str(recv_dtype).lower().replace("torch.", "") in ("fp8", "e4m3", "fp8_e4m3",
                                                                                       "float8_e4m3fn")
    if fp8 and torch.is_grad_enabled() and (x.requires_grad or (topk_weights is not None and topk_weights.requires_grad)):
        _arg_error("fp8 dispatch has no backward: run it under torch.no_grad() or with inputs that need no grad")
    if topk_weights is not None and topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    box: Dict[str, Any] = {}
    recv_x, w, ridx, counts = DispatchFunction.apply(handle, x, topk_weights, topk_idx, recv_dtype, box)
    inner = box["result"]
    res = DispatchResult(recv_x=recv_x, recv_scales=inner.recv_scales, tokens_per_local_expert=counts,
                         num_rows=inner.num_rows, layout=handle.layout, algo=handle.algo, align=handle.align)
    if handle.layout == "token":
        res.recv_topk_idx, res.recv_topk_weights = ridx, w
    else:
        res.recv_probs = w
    return res


def combine(handle: Handle, y: torch.Tensor, row_probs: Optional[torch.Tensor] = None, *, weighted: Optional[bool] = None,
            out_dtype=None) -> torch.Tensor:
    """Autograd-aware :meth:`epx.Handle.combine`. ``weighted`` defaults to True in the expert
    layout when ``row_probs`` is given or the handle is low-latency, else False (token layout
    rows are always summed unweighted). Pass ``row_probs`` (e.g. the ``recv_probs`` of
    :func:`dispatch`) to get gradients for the probabilities."""
    if weighted is None:
        weighted = handle.layout == "expert" and (row_probs is not None or handle.algo == "ll")
    if row_probs is not None and not weighted:
        _arg_error("row_probs given with weighted=False")
    if row_probs is not None and row_probs.dtype != torch.float32:
        row_probs = row_probs.float()
    return CombineFunction.apply(handle, y, row_probs, weighted, out_dtype)


# =============================================================================================
# Megatron-style flex token dispatcher
# =============================================================================================

_MODES = ("train", "prefill", "decode")


class FlexTokenDispatcher:
    """Megatron-LM's flex token dispatcher over epx.

    ``comm``: this rank's :class:`epx.Comm`. ``algos``: the algorithm per mode, default
    ``{'train': 'ht', 'prefill': 'ht', 'decode': 'll'}``. ``align``: pad each local expert's
    block to a multiple of ``align`` rows (e.g. 16 or 128 for fp8 grouped GEMMs; HT only).
    ``apply_probs_in_combine``: False (Megatron's convention) hands the per-row probabilities
    to the experts and combines unweighted; True multiplies in combine instead (as DeepEP's
    low-latency combine does).

    Per forward::

        x, probs = d.dispatch_preprocess(hidden_states, routing_map, probs)   # or topk_idx=, topk_weights=
        x, probs = d.token_dispatch(x, probs)
        x, tokens_per_expert, probs = d.dispatch_postprocess(x, probs)
        y = experts(x, tokens_per_expert, probs)                              # grouped GEMM
        y = d.combine_preprocess(y)
        y = d.token_combine(y)
        out = d.combine_postprocess(y)

    HT modes return ``x`` as ``[rows, H]`` rows grouped by local expert (padding rows zero,
    their prob 0) and ``tokens_per_expert`` as a CPU int64 tensor of block sizes (counts padded
    to ``align``; ``num_tokens_per_expert`` keeps the unpadded counts). Decode ('ll') returns
    the fixed buffers ``[L, R * max_tokens_per_rank, H]`` and the counts as a device tensor
    (no host sync, CUDA-graph capturable): use a masked grouped GEMM over the first
    ``tokens_per_expert[l]`` rows of each block.

    One dispatcher per MoE layer: its handles hold the plan that both backward passes reuse.
    """

    def __init__(self, comm: Comm, *, algos: Optional[Dict[str, str]] = None, mode: str = "train", align: int = 1,
                 apply_probs_in_combine: bool = False, recv_dtype=None, exact: bool = True):
        self.comm = comm
        self.algos = {"train": "ht", "prefill": "ht", "decode": "ll"}
        if algos:
            for k, v in algos.items():
                self.set_algo(k, v)
        self.align = int(align)
        self.apply_probs_in_combine = bool(apply_probs_in_combine)
        self.recv_dtype = recv_dtype
        self.exact = exact
        self._handles: Dict[str, Handle] = {}
        self.mode = None
        self.set_mode(mode)
        self._reset()

    # -- configuration -------------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.comm.num_local_experts

    @property
    def local_expert_ids(self):
        """Global ids of this rank's experts, in local order."""
        L = self.num_local_experts
        return list(range(self.comm.rank * L, (self.comm.rank + 1) * L))

    def set_algo(self, mode: str, algo: str) -> None:
        if mode not in _MODES:
            _arg_error(f"unknown mode {mode!r}: use one of {_MODES}")
        _parse_algo(algo)
        self.algos[mode] = algo

    def set_mode(self, mode: str) -> "FlexTokenDispatcher":
        """'train' / 'prefill' / 'decode': picks the algorithm (and handle) for what follows."""
        if mode not in _MODES:
            _arg_error(f"unknown mode {mode!r}: use one of {_MODES}")
        self.mode = mode
        return self

    @property
    def algo(self) -> str:
        return self.algos[self.mode]

    @property
    def handle(self) -> Handle:
        """The handle of the current algorithm (created on first use, kept)."""
        algo = self.algo
        h = self._handles.get(algo)
        if h is None:
            h = self.comm.handle(algo, "expert", align=1 if algo == "ll" else self.align, exact=self.exact)
            self._handles[algo] = h
        return h

    def _reset(self):
        self.hidden_shape = None
        self._idx = self._weights = None
        self._recv_probs = None
        self._counts = None
        self.num_tokens_per_expert = None

    # -- the six steps ---------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: Optional[torch.Tensor] = None,
                            probs: Optional[torch.Tensor] = None, *, topk_idx=None, topk_weights=None):
        """Flattens ``hidden_states [..., H]`` to ``[T, H]`` and takes the routing: a multi-hot
        ``routing_map [T, E]`` with ``probs [T, E]`` (Megatron) or ``topk_idx [T, K]`` with
        ``topk_weights [T, K]`` (DeepEP). Returns ``(hidden_states, topk_weights)``."""
        H = self.comm.hidden
        if hidden_states.shape[-1] != H:
            _shape_error(f"hidden_states has hidden size {hidden_states.shape[-1]}, the comm's is {H}")
        self._reset()
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, H)
        if routing_map is not None:
            if topk_idx is not None:
                _arg_error("pass routing_map (+ probs) or topk_idx (+ topk_weights), not both")
            idx, w = map_to_topk(routing_map, probs, self.comm.topk)
        elif topk_idx is not None:
            if probs is not None:
                _arg_error("probs goes with routing_map; with topk_idx pass topk_weights")
            idx = topk_idx
            w = topk_weights.float() if topk_weights is not None else (topk_idx >= 0).float()
        else:
            _arg_error("a routing is required: routing_map (+ probs) or topk_idx (+ topk_weights)")
        if idx.shape[0] != x.shape[0]:
            _shape_error(f"the routing has {idx.shape[0]} tokens, hidden_states {x.shape[0]}")
        self._idx, self._weights = idx, w
        return x, w

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, async_finish: bool = True,
                       allocate_on_comm_stream: bool = True):
        """The exchange: returns ``(rows grouped by local expert, per-row probs)``. (Megatron's
        ``async_finish`` / ``allocate_on_comm_stream`` are accepted and ignored: epx's work is
        always ordered on the caller's current stream.)"""
        if self._idx is None:
            _arg_error("call dispatch_preprocess first")
        res = dispatch(self.handle, hidden_states, self._idx, probs, recv_dtype=self.recv_dtype)
        self._counts = res.tokens_per_local_expert
        self._recv_probs = res.recv_probs
        self._result = res
        return res.recv_x, res.recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns ``(hidden_states, tokens_per_expert, probs)`` for the grouped GEMM."""
        h = self.handle
        if h.algo == "ll":
            self.num_tokens_per_expert = self._counts
            return hidden_states, self._counts, probs
        counts = self._counts.long()
        if counts.device.type != "cpu":
            try:  # the host knows the counts (exact mode): no device read-back
                counts = torch.from_numpy(h.info().tokens_per_local_expert.astype(np.int64))
            except UnsupportedError:  # sync-free: stay on the device
                pass
        self.num_tokens_per_expert = counts
        padded = (counts + self.align - 1) // self.align * self.align
        return hidden_states, padded, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Identity: the expert outputs are already in the layout combine takes."""
        if hidden_states.shape[-1] != self.comm.hidden:
            _shape_error(f"expert output has hidden size {hidden_states.shape[-1]}, the comm's is {self.comm.hidden}")
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True) -> torch.Tensor:
        """The exchange back: ``[T, H]`` (weighted by the probs if ``apply_probs_in_combine``)."""
        if self.apply_probs_in_combine:
            p = self._recv_probs if (torch.is_grad_enabled() and self._recv_probs is not None
                                     and self._recv_probs.requires_grad) else None
            return combine(self.handle, hidden_states, p, weighted=True)
        return combine(self.handle, hidden_states, None, weighted=False)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.reshape(self.hidden_shape)

    # -- conveniences ------------------------------------------------------------------------
    def dispatch(self, hidden_states, routing_map=None, probs=None, *, topk_idx=None, topk_weights=None):
        """Steps 1-3: returns ``(x, tokens_per_expert, probs)``."""
        x, p = self.dispatch_preprocess(hidden_states, routing_map, probs, topk_idx=topk_idx, topk_weights=topk_weights)
        x, p = self.token_dispatch(x, p)
        return self.dispatch_postprocess(x, p)

    def combine(self, expert_output):
        """Steps 4-6."""
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(expert_output)))

    def close(self):
        for h in self._handles.values():
            h.close()
        self._handles.clear()


# =============================================================================================
# Process groups
# =============================================================================================


def world_from_torch_distributed(group=None, backend="auto", device: Optional[int] = None) -> World:
    """One rank of a ``torch.distributed`` group, bootstrapped through the group's allgather
    (``all_gather_into_tensor`` on NCCL groups, ``all_gather_object`` otherwise). Collective
    over the group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        _arg_error("torch.distributed is not initialised (call init_process_group first)")
    rank = dist.get_rank(group)
    n = dist.get_world_size(group)
    pg_backend = str(dist.get_backend(group)).lower()
    if device is None and str(backend) in ("cuda", "auto") and torch.cuda.is_available():
        device = torch.cuda.current_device()

    def allgather(mine: bytes):
        if "nccl" in pg_backend:
            dev = torch.device("cuda", torch.cuda.current_device())
            nb = len(mine)
            out = torch.empty(n * max(nb, 1), dtype=torch.uint8, device=dev)
            src = torch.zeros(max(nb, 1), dtype=torch.uint8, device=dev)
            if nb:
                src.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
            dist.all_gather_into_tensor(out, src, group=group)
            b = out.cpu().numpy().tobytes()
            step = max(nb, 1)
            return [b[i * step:i * step + nb] for i in range(n)]
        objs = [None] * n
        dist.all_gather_object(objs, bytes(mine), group=group)
        return objs

    return World.from_allgather(allgather, rank, n, backend=backend, device=device)
