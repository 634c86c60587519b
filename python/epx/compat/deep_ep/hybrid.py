"""HybridEP's ``HybridEPBuffer`` on epx: dispatch straight into the expert layout (rows grouped
by local expert for a grouped GEMM) and combine back from it, as Megatron-LM's ``hybridep``
flex backend calls them.

Each ``dispatch_with_permute`` with a routing makes a new epx plan, held by the handle it
returns until the framework drops that handle, so many layers may be in flight at once."""

from typing import Optional

import torch

import epx

from . import _runtime

__all__ = ["HybridEPBuffer"]


def map_to_slots(routing_map: torch.Tensor, probs: Optional[torch.Tensor], topk: int):
    """Routing map [T, E] (+ probs) -> (idx int64 [T, K] in ascending expert id, -1 padded;
    weights float32 [T, K]); ValueError when a row has more than K experts."""
    T, E = routing_map.shape
    m = routing_map.bool()
    if T and topk < E and int(m.sum(1).max()) > topk:  # (a host sync on CUDA, only where rows could overflow)
        raise ValueError(f"a routing_map row selects {int(m.sum(1).max())} experts, more than this buffer's top-k {topk}")
    ids = torch.arange(E, device=m.device).expand(T, E)
    key = torch.where(m, ids, torch.full_like(ids, E))
    k = min(topk, E)
    idx = torch.sort(key, dim=1).values[:, :k]
    if k < topk:
        idx = torch.cat([idx, idx.new_full((T, topk - k), E)], 1)
    valid = idx < E
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    w = torch.zeros(T, topk, dtype=torch.float32, device=m.device)
    if probs is not None:
        w = torch.where(valid, probs.float().gather(1, safe), w)
    else:
        w = valid.float()
    return torch.where(valid, idx, torch.full_like(idx, -1)), w


class _Owner:
    """Holds the epx plan; closing it when this is collected (tuples cannot be weakly
    referenced, so the handle tuple carries one of these)."""

    def __init__(self, handle):
        self.handle = handle


class _HybridPlan(tuple):
    """The handle ``dispatch_with_permute`` returns: a tuple whose last element is the device
    flag HybridEP reports drops in (int32 [1], nonzero when this plan dropped pairs past the
    receive budget on some rank). The epx plan and what combine needs ride along as
    attributes."""

    def __new__(cls, handle, idx, num_tokens, num_experts, budget, dropped, stream=None):
        owner = _Owner(handle)
        _runtime.own(owner, handle, stream)
        self = super().__new__(cls, (owner, idx, dropped))
        self.handle, self.idx, self.num_tokens, self.num_experts = handle, idx, num_tokens, num_experts
        self.budget = budget
        return self


class HybridEPBuffer:
    """``HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
    use_fp8=False, ...)``. ``max_num_of_tokens_per_rank`` may differ between ranks (epx takes the
    group's largest); the SM and block counts are accepted and the dispatch SM count is epx's
    SM budget."""

    def __init__(self, group, hidden_dim: int, max_num_of_tokens_per_rank: int, num_local_experts: int,
                 use_fp8: bool = False, num_sms_dispatch_api: Optional[int] = None,
                 num_sms_combine_api: Optional[int] = None, num_blocks_permute: Optional[int] = None,
                 num_blocks_unpermute: Optional[int] = None, num_sms_preprocessing_api: Optional[int] = None,
                 **_ignored):
        if use_fp8:
            raise NotImplementedError("epx.compat.deep_ep.HybridEPBuffer: use_fp8 is not supported yet")
        self.group = group
        self.hidden_dim = int(hidden_dim)
        self.max_num_of_tokens_per_rank = int(max_num_of_tokens_per_rank)
        self.num_local_experts = int(num_local_experts)
        self.group_size = group.size()
        self.num_experts = self.num_local_experts * self.group_size
        self.num_sms = int(num_sms_dispatch_api or 0)
        self.world = _runtime.world_for(group)
        limit = _runtime.CUDA_MAX_TOPK if self.world.backend == "cuda" else epx.MAX_TOPK
        # Routing maps carry no top-k: plans are sized for the most experts a row may select.
        self.topk = min(self.num_experts, limit)
        self._comm_stream = None

    def _comm(self):
        return _runtime.comm_for(self.group, num_experts=self.num_experts, hidden=self.hidden_dim, topk=self.topk,
                                 max_tokens=max(self.max_num_of_tokens_per_rank, 1), num_sms=self.num_sms)

    def _stream_for(self, t):
        if t.is_cuda and self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream()
        return self._comm_stream if t.is_cuda else None

    def dispatch_with_permute(self, hidden: torch.Tensor, routing_map: Optional[torch.Tensor] = None,
                              probs: Optional[torch.Tensor] = None, scaling_factor=None,
                              num_of_experts_per_rank: Optional[int] = None, pad_multiple: Optional[int] = None,
                              num_permuted_tokens: Optional[int] = None, non_blocking: bool = False,
                              handle=None, fuse_permute_dispatch: bool = False, topk_idx=None,
                              num_of_experts: Optional[int] = None, **_ignored):
        """``(x [P, H] grouped by local expert, probs [P], scaling_factor (None), tokens_per_expert
        [L], handle)``. Each expert's block is padded to ``pad_multiple`` rows (zeros) and
        ``tokens_per_expert`` counts the padded rows. With ``num_permuted_tokens`` and
        ``non_blocking``: x has exactly that many rows, pairs past that receive budget are dropped
        (the contract's rule) and ``handle[-1]`` says so. ``handle=`` replays that plan's layout
        (combine's backward): probs is then None, or the plan's row probabilities when ``probs`` is
        passed again (a recomputed forward). The routing may also come as ``topk_idx [T, K]``
        (global ids, -1 = none) with dense ``probs [T, E]``; ``routing_map`` wins when both are
        given."""
        if scaling_factor is not None:
            raise NotImplementedError("epx.compat.deep_ep.HybridEPBuffer: fp8 scaling_factor is not supported yet")
        if num_of_experts_per_rank is not None and int(num_of_experts_per_rank) != self.num_local_experts:
            raise ValueError(f"num_of_experts_per_rank {num_of_experts_per_rank} differs from the buffer's "
                             f"{self.num_local_experts}")
        align = int(pad_multiple or 1)
        sc = _runtime.CommStreamScope(self._stream_for(hidden), [hidden, routing_map, probs])
        if handle is not None:
            with sc.run(), torch.no_grad():
                res = handle.handle.dispatch(hidden.detach().contiguous())
                x = self._fit(res.recv_x, handle.budget)
                counts = self._padded_counts(res.tokens_per_local_expert, align)
            sc.finish([x, counts])
            p = handle.recv_probs if probs is not None else None
            return x, p, None, counts, handle
        T = hidden.shape[0]
        if num_of_experts is not None and int(num_of_experts) != self.num_experts:
            raise ValueError(f"num_of_experts {num_of_experts} differs from the buffer's {self.num_experts}")
        if routing_map is None and topk_idx is not None:
            routing_map = self._map_of(topk_idx, T)
        if routing_map is None:
            raise ValueError("dispatch_with_permute needs routing_map or topk_idx (or a handle from an earlier dispatch)")
        if routing_map.shape != (T, self.num_experts):
            raise ValueError(f"routing_map must be [{T}, {self.num_experts}], got {tuple(routing_map.shape)}")
        budget = int(num_permuted_tokens) if (non_blocking and num_permuted_tokens is not None) else None
        idx, w = map_to_slots(routing_map, probs, self.topk)
        comm = self._comm()
        _runtime.reap()
        h = self._make_handle(comm, align, budget)
        with sc.run(), torch.no_grad():  # everything that reads the results, on the comm stream
            res = h.dispatch(hidden.detach().contiguous(), idx, w)
            x, p = self._fit(res.recv_x, budget), self._fit(res.recv_probs, budget)
            counts = self._padded_counts(res.tokens_per_local_expert, align)
        dropped = res.dropped
        plan = _HybridPlan(h, idx, T, self.num_experts, budget, dropped, sc.comm_stream if sc.cuda else None)
        plan.recv_probs = p
        sc.finish([x, p, counts, dropped])
        return x, p, None, counts, plan

    def _map_of(self, topk_idx: torch.Tensor, T: int) -> torch.Tensor:
        if topk_idx.dim() != 2 or topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx must be [{T}, K], got shape {tuple(topk_idx.shape)}")
        if T and (int(topk_idx.max()) >= self.num_experts or int(topk_idx.min()) < -1):
            raise ValueError(f"topk_idx holds ids outside [-1, {self.num_experts})")
        m = torch.zeros(T, self.num_experts + 1, dtype=torch.bool, device=topk_idx.device)
        m.scatter_(1, torch.where(topk_idx >= 0, topk_idx, torch.full_like(topk_idx, self.num_experts)).long(), True)
        return m[:, :self.num_experts]

    def _make_handle(self, comm, align, budget):
        if budget is None:
            return comm.handle("ht", "expert", align=align)
        try:
            return comm.handle("ht", "expert", align=align, recv_budget=budget)
        except TypeError:
            raise NotImplementedError("this epx has no receive budget (num_permuted_tokens with non_blocking)")

    @staticmethod
    def _fit(rows: torch.Tensor, budget: Optional[int]) -> torch.Tensor:
        """A receive buffer of exactly `budget` rows (zeros past the rows in use)."""
        if budget is None or rows.shape[0] == budget:
            return rows
        out = rows.new_zeros((budget,) + tuple(rows.shape[1:]))
        n = min(budget, rows.shape[0])
        out[:n] = rows[:n]
        return out

    @staticmethod
    def _padded_counts(counts: torch.Tensor, align: int) -> torch.Tensor:
        c = counts.to(torch.int64)
        return (c + align - 1) // align * align

    def combine_with_unpermute(self, hidden: torch.Tensor, probs: Optional[torch.Tensor] = None, handle=None,
                               pad_multiple: Optional[int] = None, fuse_unpermute_combine: bool = False, **_ignored):
        """The inverse of the handle's dispatch: ``(combined [T, H], probs_grad [T, E] or None)``.
        ``combined[t]`` sums the token's rows unweighted (per destination in local-expert order,
        then over destinations in rank order, float32, rounded once each); ``probs [P]`` (one
        value per row) goes back to the token's expert columns of a dense ``[T, E]``."""
        if not isinstance(handle, _HybridPlan):
            raise TypeError("combine_with_unpermute needs the handle an epx dispatch_with_permute returned")
        plan = handle
        y = hidden.detach().contiguous()
        rwg = None if probs is None else probs.detach().float().reshape(-1).contiguous()
        sc = _runtime.CommStreamScope(self._stream_for(hidden), [y, rwg])
        with sc.run(), torch.no_grad():
            res = plan.handle.combine(y, out_dtype=hidden.dtype, weighted=False, row_weight_grad=rwg)
            out, twg = res if rwg is not None else (res, None)
            dense = None
            if twg is not None:
                dense = torch.zeros(plan.num_tokens, plan.num_experts, dtype=torch.float32, device=hidden.device)
                valid = plan.idx >= 0
                dense.scatter_add_(1, torch.where(valid, plan.idx, torch.zeros_like(plan.idx)),
                                   torch.where(valid, twg, torch.zeros_like(twg)))
        sc.finish([out, dense])
        return out, dense
