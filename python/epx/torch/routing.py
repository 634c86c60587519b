"""Routing helpers, torch-native: any device, differentiable in the weights."""

from __future__ import annotations

from typing import Optional

import torch

from .._lib import Status
from ..errors import TopkRangeError, _shape_error


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
