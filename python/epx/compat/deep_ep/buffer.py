"""DeepEP's ``Buffer`` (normal, high-throughput mode) on epx: the token-layout dispatch and
combine that Megatron-LM's ``deepep`` flex backend and NeMo Automodel call.

One Buffer serves every layer and microbatch of a process: each ``dispatch`` that is given a
routing makes a new epx plan, held by the handle it returns until the framework drops that
handle (after the layer's backward), so any number of layers can be in flight, each holding
memory in proportion to what it routed."""

from typing import List, Optional, Tuple

import torch

import epx

from . import _runtime
from .utils import EventOverlap

__all__ = ["Buffer", "Config"]


class Config:
    """DeepEP's performance config. epx sizes its own buffers, so the chunk sizes are kept only
    to answer the size hints frameworks use to decide whether a Buffer is big enough."""

    def __init__(self, num_sms: int = 20, nvl_chunk_size: int = 6, nvl_buffer_size: int = 256,
                 rdma_chunk_size: int = 6, rdma_buffer_size: int = 256):
        self.num_sms = int(num_sms)
        self.nvl_chunk_size = int(nvl_chunk_size)
        self.nvl_buffer_size = int(nvl_buffer_size)
        self.rdma_chunk_size = int(rdma_chunk_size)
        self.rdma_buffer_size = int(rdma_buffer_size)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of one rank's receive staging for `nvl_buffer_size` tokens per peer."""
        return int(hidden_bytes) * int(num_ranks) * self.nvl_buffer_size

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """epx has no RDMA path: 0."""
        return 0


class _Plan:
    """What ``dispatch`` hands back as its handle: the epx plan and the shapes combine needs."""

    def __init__(self, handle: "epx.Handle", num_tokens: int, idx_dtype):
        self.handle = handle
        self.num_tokens = num_tokens
        self.idx_dtype = idx_dtype


def _check_idx(topk_idx: torch.Tensor):
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_idx must be int64 (or int32), got {topk_idx.dtype}")


def layout_counts(topk_idx: torch.Tensor, num_ranks: int, num_experts: int):
    """(tokens per rank [R] int32, pairs per expert [E] int32, is_token_in_rank [T, R] bool) of a
    routing (-1 = no expert): epx_layout_counts on CPU tensors, the same integers computed with
    torch on CUDA tensors (no host synchronisation)."""
    if topk_idx.device.type == "cpu" and hasattr(epx, "layout_counts"):
        return epx.layout_counts(topk_idx, nranks=num_ranks, num_experts=num_experts)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts {num_experts} is not a multiple of {num_ranks} ranks")
    L = num_experts // num_ranks
    valid = topk_idx >= 0
    e = torch.where(valid, topk_idx, torch.zeros_like(topk_idx)).long()
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    per_expert.scatter_add_(0, e[valid], torch.ones_like(e[valid]))
    T = topk_idx.shape[0]
    in_rank = torch.zeros(T, num_ranks, dtype=torch.bool, device=topk_idx.device)
    rows = torch.arange(T, device=topk_idx.device).unsqueeze(1).expand_as(e)
    in_rank[rows[valid], (e // L)[valid]] = True
    return in_rank.sum(0).to(torch.int32), per_expert.to(torch.int32), in_rank


class Buffer:
    """DeepEP's ``Buffer(group, num_nvl_bytes, num_rdma_bytes, ...)`` on epx.

    The byte sizes are recorded (frameworks compare them to decide whether to make a bigger
    Buffer) but epx sizes its own memory. ``low_latency_dispatch`` / ``low_latency_combine``
    (decode) run on epx's low-latency path with DeepEP's shapes."""

    num_sms = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, **_ignored):
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.rank = group.rank()
        self.group_size = group.size()
        self.world = _runtime.world_for(group)
        self._comm_stream = None
        self._destroyed = False

    # -- DeepEP's static configuration -----------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SM budget (epx's num_sms) of the comms made after this call."""
        n = int(new_num_sms)
        if n < 1:
            raise ValueError(f"num_sms must be >= 1, got {n}")
        Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def capture():
        """An event on the current stream (DeepEP's ``Buffer.capture``)."""
        return EventOverlap(_runtime.EventHandle())

    # -- life cycle -----------------------------------------------------------------------
    def get_comm_stream(self):
        """The stream epx's work goes to (CUDA), made on first use."""
        if self._comm_stream is None and torch.cuda.is_available():
            self._comm_stream = torch.cuda.Stream()
        return self._comm_stream

    def destroy(self) -> None:
        """Frees the comms of this buffer's group (``explicitly_destroy=True`` users call it)."""
        if not self._destroyed:
            self._destroyed = True
            _runtime.release(self.group)

    def _check_alive(self):
        if self._destroyed:
            raise RuntimeError("this deep_ep.Buffer was destroyed")

    def _scope(self, tensors, previous_event, async_finish, allocate_on_comm_stream):
        stream = self.get_comm_stream() if any(t is not None and t.is_cuda for t in tensors) else None
        return _runtime.CommStreamScope(stream, tensors, previous_event, async_finish, allocate_on_comm_stream)

    def _comm(self, num_experts: int, hidden: int, topk: int, num_tokens: int):
        if torch.cuda.is_available() and topk > _runtime.CUDA_MAX_TOPK and self.world.backend == "cuda":
            raise ValueError(f"epx's CUDA backend takes top-k up to {_runtime.CUDA_MAX_TOPK}, got {topk}")
        # The CUDA backend sizes its buffers for max_tokens_per_rank: the first call's tokens,
        # rounded up, cover a framework's fixed microbatch (EPX_IPC_ARENA_MB overrides).
        T = max(int(num_tokens), 1)
        return _runtime.comm_for(self.group, num_experts=num_experts, hidden=hidden, topk=topk,
                                 max_tokens=1 << (T - 1).bit_length(), num_sms=Buffer.num_sms)

    # -- layout ---------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [R] int, None, num_tokens_per_expert [E] int, is_token_in_rank
        [T, R] bool, event)``. The second value (tokens per RDMA rank) is None: one node."""
        self._check_alive()
        _check_idx(topk_idx)
        sc = self._scope([topk_idx], previous_event, async_finish, allocate_on_comm_stream)
        with sc.run():
            per_rank, per_expert, in_rank = layout_counts(topk_idx, self.group_size, int(num_experts))
        event = sc.finish([per_rank, per_expert, in_rank])
        return per_rank, None, per_expert, in_rank, event

    # -- dispatch -------------------------------------------------------------------------
    def dispatch(self, x, handle: Optional[_Plan] = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Token-layout dispatch. With a routing: ``(recv_x [N, H], recv_topk_idx [N, K] local
        ids / -1, recv_topk_weights [N, K], num_recv_tokens_per_expert_list, handle, event)``.
        With ``handle=`` (the cached layout of an earlier dispatch: combine's backward):
        ``(recv_x, None, None, None, None, event)``. ``x`` may be a tuple (fp8 data, scales):
        not supported yet."""
        self._check_alive()
        if isinstance(x, tuple):
            raise NotImplementedError("epx.compat.deep_ep: fp8 (data, scales) dispatch input is not supported yet")
        if expert_alignment != 1 or num_worst_tokens:
            raise NotImplementedError("epx.compat.deep_ep: expert_alignment / num_worst_tokens are not supported yet")
        if handle is not None:
            return self._dispatch_cached(x, handle, previous_event, async_finish, allocate_on_comm_stream)
        if topk_idx is None:
            raise ValueError("dispatch needs topk_idx (or a handle from an earlier dispatch)")
        _check_idx(topk_idx)
        T, K = topk_idx.shape
        if x.dim() != 2 or x.shape[0] != T:
            raise ValueError(f"x must be [{T}, hidden], got shape {tuple(x.shape)}")
        num_experts = self._num_experts(num_tokens_per_expert)
        comm = self._comm(num_experts, x.shape[1], K, T)
        w = None if topk_weights is None else topk_weights.detach()
        if w is not None and w.dtype != torch.float32:
            raise TypeError(f"topk_weights must be float32 (DeepEP's rule), got {w.dtype}")
        sc = self._scope([x, topk_idx, w], previous_event, async_finish, allocate_on_comm_stream)
        _runtime.reap()
        h = comm.handle("ht", "token")
        with sc.run(), torch.no_grad():  # everything that reads the results, on the comm stream
            res = h.dispatch(x.detach(), topk_idx, w)
            recv_idx = res.recv_topk_idx.to(topk_idx.dtype)
            counts: List[int] = [int(c) for c in res.tokens_per_local_expert.tolist()]
        recv_w = res.recv_topk_weights
        plan = _Plan(h, T, topk_idx.dtype)
        _runtime.own(plan, h, sc.comm_stream if sc.cuda else None)
        event = sc.finish([res.recv_x, recv_idx, recv_w])
        return res.recv_x, recv_idx, (recv_w if topk_weights is not None else None), counts, plan, event

    def _num_experts(self, num_tokens_per_expert) -> int:
        if num_tokens_per_expert is None:
            raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) to know the expert count")
        return int(num_tokens_per_expert.numel())

    def _dispatch_cached(self, x, plan: _Plan, previous_event, async_finish, allocate_on_comm_stream):
        if x.dim() != 2 or x.shape[0] != plan.num_tokens:
            raise ValueError(f"x must be [{plan.num_tokens}, hidden] like the handle's dispatch, got {tuple(x.shape)}")
        sc = self._scope([x], previous_event, async_finish, allocate_on_comm_stream)
        with sc.run(), torch.no_grad():
            res = plan.handle.dispatch(x.detach().contiguous())
        event = sc.finish([res.recv_x])
        return res.recv_x, None, None, None, None, event

    # -- combine --------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: _Plan, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """The inverse of the handle's dispatch: ``(combined_x [T, H], combined_topk_weights
        [T, K] or None, event)``. ``combined_x[t]`` is the float32 sum of the rows that come back
        for token t, in rank order, rounded once (unweighted); ``topk_weights [N, K]`` rows go back
        to their slots."""
        self._check_alive()
        if bias is not None:
            raise NotImplementedError("epx.compat.deep_ep: combine bias is not supported yet")
        if not isinstance(handle, _Plan):
            raise TypeError("combine needs the handle an epx deep_ep dispatch returned")
        w = None if topk_weights is None else topk_weights.detach().float().contiguous()
        sc = self._scope([x, w], previous_event, async_finish, allocate_on_comm_stream)
        with sc.run(), torch.no_grad():
            res = handle.handle.combine(x.detach().contiguous(), out_dtype=x.dtype, weighted=False, row_weight_grad=w)
        out, cw = res if w is not None else (res, None)
        event = sc.finish([out, cw])
        return out, cw, event

    # -- low-latency mode (decode) --------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """``(recv_x [L, R * M, H] (bf16, or with use_fp8 a tuple (e4m3 data, float32 scales [L, R * M,
        H / 128])), recv_count [L] int32, handle, event, hook)``: local expert l's rows are the first
        ``recv_count[l]`` of its block, in (source rank, source token) order. Everything is done
        when the call returns, so ``hook()`` has nothing left to do."""
        self._check_alive()
        if round_scale or use_ue8m0:
            raise NotImplementedError("epx.compat.deep_ep: round_scale / use_ue8m0 are not supported yet")
        _check_idx(topk_idx)
        M = int(num_max_dispatch_tokens_per_rank)
        comm = _runtime.comm_for(self.group, num_experts=int(num_experts), hidden=x.shape[1], topk=topk_idx.shape[1],
                                 max_tokens=M, num_sms=Buffer.num_sms, algo=f"ll{M}")
        sc = self._scope([x, topk_idx], None, async_finish, False)
        _runtime.reap()
        h = comm.handle("ll")
        with sc.run(), torch.no_grad():
            res = h.dispatch(x.detach().contiguous(), topk_idx, None, recv_dtype="fp8" if use_fp8 else None)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats += res.tokens_per_local_expert.to(
                    cumulative_local_expert_recv_stats.dtype)
        plan = _Plan(h, topk_idx.shape[0], topk_idx.dtype)
        plan.max_tokens, plan.num_experts = M, int(num_experts)
        _runtime.own(plan, h, sc.comm_stream if sc.cuda else None)
        recv = (res.recv_x, res.recv_scales) if use_fp8 else res.recv_x
        event = sc.finish([res.recv_x, res.recv_scales, res.tokens_per_local_expert])
        return recv, res.tokens_per_local_expert, plan, event, (lambda: None)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: _Plan, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out=None):
        """``(combined_x [T, H], event, hook)``: ``combined_x[t]`` = sum over the token's experts of
        ``topk_weights[t, k]`` times that expert's row, by epx's contract (per destination in local
        expert order, then over ranks; float32, products rounded before they are added).

        DeepEP takes the weights here rather than at dispatch, so they first travel to the
        experts' ranks: one more low-latency exchange, of K weights and K ids per token."""
        self._check_alive()
        if use_logfmt or zero_copy:
            raise NotImplementedError("epx.compat.deep_ep: use_logfmt / zero_copy are not supported yet")
        if not isinstance(handle, _Plan) or not hasattr(handle, "max_tokens"):
            raise TypeError("low_latency_combine needs the handle low_latency_dispatch returned")
        w = topk_weights.detach().float().contiguous()
        sc = self._scope([x, topk_idx, w], None, async_finish, False)
        with sc.run(), torch.no_grad():
            probs = self._row_weights(handle, topk_idx, w)
            res = handle.handle.combine(x.detach().contiguous(), weighted=True, row_probs=probs, out_dtype=x.dtype)
            if out is not None:
                out.copy_(res)
                res = out
        event = sc.finish([res])
        return res, event, (lambda: None)

    def _row_weights(self, plan: _Plan, topk_idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each received row's weight [L * R * M]: the source's (weights, ids) rows dispatched with
        the same routing land on the same rows; the id that names this rank's expert picks the
        weight."""
        T, K = topk_idx.shape
        width = (2 * K + 3) // 4 * 4  # a row of whole 16-byte vectors
        comm = _runtime.comm_for(self.group, num_experts=plan.num_experts, hidden=width, topk=K,
                                 max_tokens=plan.max_tokens, num_sms=Buffer.num_sms, algo=f"llw{plan.max_tokens}")
        pack = torch.zeros(T, width, dtype=torch.float32, device=w.device)
        pack[:, :K] = w
        pack[:, K:2 * K] = topk_idx.to(torch.int32).view(torch.float32)
        with comm.handle("ll") as hw:
            got = hw.dispatch(pack, topk_idx, None).recv_x  # [L, R * M, width]
        L = plan.num_experts // self.group_size
        ids = got[..., K:2 * K].contiguous().view(torch.int32)
        mine = (self.rank * L + torch.arange(L, device=w.device)).view(L, 1, 1)
        hit = ids == mine
        return torch.where(hit, got[..., :K], torch.zeros_like(got[..., :K])).sum(-1).reshape(-1).contiguous()
