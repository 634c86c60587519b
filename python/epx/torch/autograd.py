"""Autograd through dispatch and combine: each one's gradient is the other, with the same
handle (see :mod:`epx.torch`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

from ..collective import _Collective
from ..errors import _arg_error
from ..handle import Handle
from ..results import DispatchResult
from .routing import map_to_topk


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
    # a rank refused here still takes part in the dispatch its peers make (epx.collective)
    with _Collective(handle.comm, handle._dispatch_refusal(True, False)):
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
        needs_grad = x.requires_grad or (topk_weights is not None and topk_weights.requires_grad)
        if fp8 and torch.is_grad_enabled() and needs_grad:
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
    with _Collective(handle.comm, handle._refuse_combine):
        if weighted is None:
            weighted = handle.layout == "expert" and (row_probs is not None or handle.algo == "ll")
        if row_probs is not None and not weighted:
            _arg_error("row_probs given with weighted=False")
        if row_probs is not None and row_probs.dtype != torch.float32:
            row_probs = row_probs.float()
        return CombineFunction.apply(handle, y, row_probs, weighted, out_dtype)
